"""NxD's parameter lists, written as stubs with NxD's signatures (facts about
aws-neuron/neuronx-distributed's source, torch-xla's ZeroRedundancyOptimizer for
``NeuronZero1Optimizer``), for test_import_surface.py.

A stub parameter without a default has none in NxD (nxd may give it one: NxD's calls still
work); the default ``ANY`` marks one nxd deliberately changes (``weights_only=True``: the
project never unpickles code from legacy files). ``SIGNATURES`` maps the nxd target to its stub
and to how many leading parameters must sit in NxD's positions: those NxD's code and its API
reference agree on (and NxD's examples pass positionally). Past that point the two disagree
(e.g. ``ColumnParallelLinear``: the reference puts ``sequence_parallel_enabled`` fifth, the
source ``dtype``) and nxd follows the reference, so only names and defaults are compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ANY: Any = object()
f32 = torch.float32


def column_parallel_linear(input_size, output_size, bias=True, gather_output=True, dtype=f32,
    device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
    keep_master_weight=False, skip_bias_add=False, pad=False): ...  # fmt: skip
def row_parallel_linear(input_size, output_size, bias=True, input_is_parallel=False, dtype=f32,
    device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
    keep_master_weight=False, skip_bias_add=False, pad=False): ...  # fmt: skip
def parallel_embedding(num_embeddings, embedding_dim, padding_idx=None, max_norm=None,
    norm_type=2.0, scale_grad_by_freq=False, sparse=False, init_method=nn.init.normal_,
    device=None, dtype=f32, shard_across_embedding=False, pad=False,
    sequence_parallel_enabled=False): ...  # fmt: skip
def gqa_qkv_column_parallel_linear(input_size, output_sizes, bias=True, gather_output=True,
    dtype=f32, device=None, init_method=None, sequence_parallel_enabled=False,
    keep_master_weight=False, kv_size_multiplier=1, fuse_qkv=False): ...  # fmt: skip
def output_channel_parallel_conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0,
    dilation=1, groups=1, bias=True, padding_mode="zeros", gather_output=True, dtype=f32,
    device=None, init_method=None, keep_master_weight=False): ...  # fmt: skip
def input_channel_parallel_conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0,
    dilation=1, groups=1, bias=True, padding_mode="zeros", input_is_parallel=False, dtype=f32,
    device=None, init_method=None, keep_master_weight=False): ...  # fmt: skip
def get_grad_norm(parameters, norm_type=2, zero1_optimizer=False, zero1_optimizer_groups=None,
    force_spmd=True): ...  # fmt: skip
def clip_grad_norm(parameters, max_norm, norm_type=2, zero1_optimizer=False,
    zero1_optimizer_groups=None, force_spmd=True): ...  # fmt: skip
def parallel_cross_entropy(parallel_logits, labels, label_smoothing=0.0): ...  # API reference
def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, inference=True): ...
def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1,
    context_parallel_size=1): ...  # fmt: skip
def initialize_kv_group(kv_shared_group_size=1, sequential_ranks_in_group=False): ...
def zero1_optimizer(params, optimizer_class, optimizer_dtype=None, grad_clipping=True,
    max_norm=None, pin_layout=True, sharding_groups=None, grad_norm_groups=None, lazy_init=False,
    bucket_cap_mb_all_gather=0, bucket_cap_mb_reduce_scatter=0, use_grad_acc_hook=False,
    save_master_weights=False, higher_cc_precision=False): ...  # fmt: skip
def nxdpp_model(module, transformer_layer_cls=None, num_microbatches=1, virtual_pipeline_size=1,
    output_loss_value_spec=None, return_mb_loss=False, broadcast_and_average_loss=False,
    use_zero1_optimizer=False, use_model_wrapper=False, use_optimizer_wrapper=False,
    pipeline_cuts=None, input_names=None, leaf_module_cls=None, autowrap_functions=None,
    autowrap_modules=None, autowrap_obj_methods=None, tracer_cls=None, param_init_fn=None,
    trace_file_path=None, return_loss_on_cpu=True, deallocate_pipeline_outputs=False,
    auto_partition=False, fuse_microbatches=False, manual_pp_partition=False,
    manual_pp_stage_partition_fn=None, manual_pp_loss_fn=None, _delay_tracing=False,
    _turn_off_odd_even_scheduler=False, _all_reduce_send_recv=False, _fused_send_recv=False,
    _fused_fwd_bwd=False, _mark_step_before_pp_runtime=True, _mark_step_after_pp_runtime=True,
    _deallocate_send_tensors=True, _use_gloo_for_metadata_comm=False, _debug_mode=False,
    _debug_pp_size=8, _debug_pp_rank=0): ...  # fmt: skip
def send(tensor, send_next=True, all_reduce_send_recv=False): ...
def recv_from(tensor_meta, recv_prev=True, tracing=False, all_reduce_send_recv=False): ...
def apply_rotary_pos_emb(q, k, cos, sin, position_ids, flash_attn, transpose_nki_inputs=True): ...
def move_model_to_device(model, device): ...
def init_on_device(device, include_buffers=False, force_custom_init_on_device=False): ...
def get_logger(name="neuronx_distributed", rank0_only=True): ...
def adamw_fp32(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
    no_deprecation_warning=True, differentiable=False, capturable=False): ...  # fmt: skip
def get_lora_model(model, lora_config): ...
def legacy_save(checkpoint, output_dir, save_serially=True, save_xser=False,
    down_cast_bf16=False, master_dp_only=True): ...  # fmt: skip
def legacy_load(chkpt_path, model=None, model_or_optimizer=None, model_key="model",
    load_xser=False, sharded=True, strict=True, master_dp_only=True,
    weights_only=ANY): ...  # fmt: skip
def save_checkpoint(checkpoint_dir_str, tag, model=None, optimizer=None, scheduler=None,
    user_content=None, num_workers=8, use_xser=False, num_kept_ckpts=None, async_save=False,
    zero1_optimizer=False, use_zero1_dcp=False): ...  # fmt: skip
def load_checkpoint(path, tag=None, model=None, optimizer=None, scheduler=None, num_workers=8,
    strict=True, use_zero1_dcp=False): ...  # fmt: skip
def has_checkpoint(checkpoint_dir_str): ...
def finalize_checkpoint(): ...
def neuronx_distributed_config(tensor_parallel_size=1, pipeline_parallel_size=1,
    expert_parallel_size=1, context_parallel_size=1, pipeline_config=None, optimizer_config=None,
    activation_checkpoint_config=None, pad_model=False, sequence_parallel=False,
    model_init_config=None, lora_config=None, mixed_precision_config=None,
    sequential_move_factor=11, lnc_size=1): ...  # fmt: skip
def initialize_parallel_model(nxd_config, model_fn): ...
def initialize_parallel_optimizer(nxd_config, optimizer_class, parameters): ...


_NXD = "neuronx_distributed"
_PL = f"{_NXD}.parallel_layers"
SIGNATURES: dict[str, tuple[Callable[..., Any], int]] = {
    f"{_PL}.layers:ColumnParallelLinear.__init__": (column_parallel_linear, 4),
    f"{_PL}.layers:RowParallelLinear.__init__": (row_parallel_linear, 4),
    f"{_PL}.layers:ParallelEmbedding.__init__": (parallel_embedding, 12),
    f"{_NXD}.modules.qkv_linear:GQAQKVColumnParallelLinear.__init__": (
        gqa_qkv_column_parallel_linear,
        4,
    ),
    f"{_PL}.layers:OutputChannelParallelConv2d.__init__": (output_channel_parallel_conv2d, 14),
    f"{_PL}.layers:InputChannelParallelConv2d.__init__": (input_channel_parallel_conv2d, 14),
    f"{_PL}.grads:get_grad_norm": (get_grad_norm, 5),
    f"{_PL}.grads:clip_grad_norm": (clip_grad_norm, 6),
    f"{_PL}.loss_functions:parallel_cross_entropy": (parallel_cross_entropy, 3),
    f"{_PL}.loss_functions:from_parallel_logits_to_logprobs": (
        from_parallel_logits_to_logprobs,
        3,
    ),
    f"{_PL}.parallel_state:initialize_model_parallel": (initialize_model_parallel, 5),
    f"{_PL}.parallel_state:initialize_kv_group": (initialize_kv_group, 2),
    f"{_PL}.checkpointing:save": (legacy_save, 6),
    f"{_PL}.checkpointing:load": (legacy_load, 1),
    f"{_NXD}.optimizer:NeuronZero1Optimizer.__init__": (zero1_optimizer, 14),
    f"{_NXD}.pipeline.model:NxDPPModel.__init__": (nxdpp_model, 26),
    f"{_NXD}.pipeline.comm:send": (send, 3),
    f"{_NXD}.pipeline.comm:recv_from": (recv_from, 4),
    f"{_NXD}.overrides.transformer_overrides:apply_rotary_pos_emb": (apply_rotary_pos_emb, 7),
    f"{_NXD}.utils.model_utils:move_model_to_device": (move_model_to_device, 2),
    f"{_NXD}.utils.model_utils:init_on_device": (init_on_device, 2),
    f"{_NXD}.utils.logger:get_logger": (get_logger, 2),
    f"{_NXD}.utils.adamw_fp32_optim_params:AdamW_FP32OptimParams.__init__": (adamw_fp32, 9),
    f"{_NXD}.modules.lora:get_lora_model": (get_lora_model, 2),
    f"{_NXD}:save_checkpoint": (save_checkpoint, 11),
    f"{_NXD}:load_checkpoint": (load_checkpoint, 7),
    f"{_NXD}:has_checkpoint": (has_checkpoint, 1),
    f"{_NXD}:finalize_checkpoint": (finalize_checkpoint, 0),
    f"{_NXD}:neuronx_distributed_config": (neuronx_distributed_config, 2),
    f"{_NXD}:initialize_parallel_model": (initialize_parallel_model, 2),
    f"{_NXD}:initialize_parallel_optimizer": (initialize_parallel_optimizer, 3),
}

# NxD's LoraConfig fields and defaults (a dataclass in NxD too).
LORA_CONFIG_FIELDS = {
    "enable_lora": False,
    "lora_rank": 16,
    "target_modules": None,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "bias": "none",
    "use_rslora": False,
    "init_lora_weights": "default",
    "modules_to_save": None,
    "lora_verbose": False,
    "load_lora_from_ckpt": False,
    "lora_load_tag": None,
    "lora_save_dir": "lora_adapter",
    "merge_lora": False,
    "save_lora_base": False,
    "save_lora_config_adapter": True,
    "merge_sharded_lora": False,
}
