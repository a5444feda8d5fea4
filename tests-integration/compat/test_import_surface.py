"""Every NxD import path and name issue 10 lists resolves, to the nxd object it re-exports, with
NxD's parameter names and defaults (``_nxd_signatures.py``). No process group is needed here:
what the names do is exercised by the other files of this folder.

Every NxD parameter listed in ``_nxd_signatures.py`` is accepted (the last gaps, NxDPPModel's
debug arguments and the trainer's CP/LNC/checkpoint keywords, closed), so a parameter NxD
adds and nxd lacks fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling

SIG = load_sibling(__file__, "_nxd_signatures")


def resolve(target: str) -> Any:
    """``"package.module:Qual.name"`` -> the object; a missing name raises ImportError."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as error:
            raise ImportError(f"{target}: no {part!r}") from error
    return obj


# NxD path -> the nxd object it must be (identity: a re-export, not a copy) ---------------------
_LAYERS = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelEmbedding",
    "BaseParallelLinear",
    "OutputChannelParallelConv2d",
    "InputChannelParallelConv2d",
    "copy_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]
_MAPPINGS = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
]
_STATE = [
    "initialize_model_parallel",
    "destroy_model_parallel",
    "model_parallel_is_initialized",
    "get_tensor_model_parallel_replica_groups",
    "get_data_parallel_replica_groups",
    "get_pipeline_model_parallel_replica_groups",
    "get_context_model_parallel_size",
    "get_context_model_parallel_rank",
    "get_context_model_parallel_group",
    "get_expert_model_parallel_size",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_group",
    "get_expert_data_parallel_size",
    "initialize_kv_group",
    "get_kv_shared_group",
    "get_kv_shared_group_size",
    "get_kv_shared_replica_groups",
    "destroy_kv_group",
]
NXD = "neuronx_distributed"
PL = f"{NXD}.parallel_layers"
# (NxD module, nxd module, names; "nxd_name=NxD_name" where the names differ)
_GROUPS: list[tuple[str, str, list[str]]] = [
    (PL, "nxd_layers", [*_LAYERS[:3], "clip_grad_norm", "split_tensor_along_last_dim"]),
    (f"{PL}.layers", "nxd_layers", _LAYERS),
    (PL, "nxd_layers.mappings", _MAPPINGS[:4]),
    (f"{PL}.mappings", "nxd_layers.mappings", _MAPPINGS),
    (f"{PL}.parallel_state", "nxd_state.parallel_state", _STATE),
    (f"{NXD}.parallel_state", "nxd_state.parallel_state", _STATE),
    (PL, "nxd_state.parallel_state", ["initialize_model_parallel"]),
    (PL, "nxd_state.rng", ["get_xla_rng_tracker=get_rng_tracker"]),
    (PL, "nxd_state.rng", ["model_parallel_xla_manual_seed=model_parallel_manual_seed"]),
    (f"{PL}.grads", "nxd_layers", ["get_grad_norm", "clip_grad_norm"]),
    (f"{PL}.grads", "nxd_layers", ["allreduce_sequence_parallel_gradients"]),
    (f"{PL}.loss_functions", "nxd_layers", ["parallel_cross_entropy"]),
    (f"{PL}.loss_functions", "nxd_layers", ["from_parallel_logits_to_logprobs"]),
    (f"{PL}.pad", "nxd_layers", ["pad_model", "get_number_of_extra_heads"]),
    (f"{PL}.utils", "nxd_layers", ["divide"]),
    (f"{PL}.utils", "nxd_state", ["move_model_to_device", "get_local_world_size"]),
    (PL, "nxd_ckpt.legacy", ["save", "load"]),
    (f"{PL}.checkpointing", "nxd_ckpt.legacy", ["save", "load"]),
    (f"{NXD}.modules.qkv_linear", "nxd_layers", ["GQAQKVColumnParallelLinear"]),
    (f"{NXD}.modules.qkv_linear", "nxd_state", ["destroy_kv_group", "get_kv_shared_group"]),
    (f"{NXD}.modules.qkv_linear", "nxd_layers", ["get_kv_size_multiplier"]),
    # NxD's re-initialisation hooks (its models' init_weights); semantics: test_layer_semantics
    (f"{PL}.layers", "nxd_layers", ["ColumnParallelLinear.init_weight_cpu"]),
    (f"{PL}.layers", "nxd_layers", ["RowParallelLinear.init_weight_cpu"]),
    (f"{PL}.layers", "nxd_layers", ["ParallelEmbedding.init_weight_cpu"]),
    (
        f"{NXD}.modules.qkv_linear",
        "nxd_layers",
        ["GQAQKVColumnParallelLinear.initialize_weight_biases"],
    ),
    (f"{PL}.layers", "nxd_layers", ["param_is_not_tensor_parallel_duplicate"]),
    (NXD, "nxd_trainer", ["save_checkpoint", "load_checkpoint"]),
    (NXD, "nxd_trainer", ["has_checkpoint", "finalize_checkpoint"]),
    (f"{NXD}.trace", "nxd_layers.trace", ["parallel_model_trace", "parallel_model_save"]),
    (f"{NXD}.trace", "nxd_layers.trace", ["parallel_model_load", "TensorParallelModel"]),
    (f"{NXD}.lightning", "nxd_lightning", ["NeuronLTModule", "NeuronXLAStrategy"]),
    (f"{NXD}.lightning", "nxd_lightning", ["NeuronXLAPrecisionPlugin", "NeuronTQDMProgressBar"]),
    (f"{NXD}.lightning", "nxd_lightning", ["NeuronTensorBoardLogger"]),
    (f"{NXD}.utils.model_utils", "nxd_state", ["move_model_to_device", "get_local_world_size"]),
    (f"{NXD}.utils.adamw_fp32_optim_params", "nxd_optim", ["AdamW_FP32OptimParams"]),
    (f"{NXD}.optimizer", "nxd_optim", ["NeuronZero1Optimizer"]),
    (f"{NXD}.optimizer.zero_redundancy_optimizer", "nxd_optim", ["NeuronZero1Optimizer"]),
    (f"{NXD}.pipeline", "nxd_pipeline", ["NxDPPModel"]),
    (f"{NXD}.pipeline.model", "nxd_pipeline", ["NxDPPModel"]),
    (f"{NXD}.pipeline.comm", "nxd_pipeline", ["send", "recv_from"]),
    (f"{NXD}.pipeline.manual_pipe_stage", "nxd_pipeline", ["PipelineStageModule"]),
    (f"{NXD}.modules.lora", "nxd_lora", ["LoraConfig", "LoraModel=LoRAModel"]),
    (f"{NXD}.modules.lora.model", "nxd_lora", ["LoraModel=LoRAModel"]),
    (f"{NXD}.modules.lora.layer", "nxd_lora", ["LoraLayer", "LoraLinear", "LoraEmbedding"]),
    (f"{NXD}.modules.lora.layer", "nxd_lora", ["LoraConv2d"]),
    (f"{NXD}.modules.lora.tp_layer", "nxd_lora", ["LoraParallelLinear"]),
    (f"{NXD}.modules.lora.tp_layer", "nxd_lora", ["LoraGQAQKVParallelLinear"]),
    (NXD, "nxd_trainer", ["neuronx_distributed_config", "initialize_parallel_model"]),
    (NXD, "nxd_trainer", ["initialize_parallel_optimizer"]),
    (f"{NXD}.trainer", "nxd_trainer", ["neuronx_distributed_config"]),
    (f"{NXD}.trainer", NXD, ["save_checkpoint", "load_checkpoint"]),
]
REEXPORTS: list[tuple[str, str]] = []
for _compat, _nxd, _names in _GROUPS:
    for _name in _names:
        _theirs, _, _mine = _name.partition("=")
        REEXPORTS.append((f"{_compat}:{_theirs}", f"{_nxd}:{_mine or _theirs}"))


@pytest.mark.parametrize(("nxd_path", "target"), REEXPORTS, ids=[p for p, _ in REEXPORTS])
def test_nxd_path_is_the_nxd_object(nxd_path: str, target: str) -> None:
    assert resolve(nxd_path) is resolve(target)


# Names the compat package defines itself (NxD's helpers with no nxd counterpart) --------------
COMPAT_DEFINED = [
    "neuronx_distributed.parallel_layers.utils:requires_init_pg_override",
    "neuronx_distributed.parallel_layers.utils:is_pjrt_device",
    "neuronx_distributed.parallel_layers.parallel_state:rmsg",
    "neuronx_distributed.pipeline.comm:rmsg",
    "neuronx_distributed.utils:cpu_mode",
    "neuronx_distributed.utils:mark_step",
    "neuronx_distributed.utils:master_print",
    "neuronx_distributed.utils:get_device",
    "neuronx_distributed.utils.logger:get_logger",
    "neuronx_distributed.utils.logger:get_log_level",
    "neuronx_distributed.utils.batch_utils:shift_labels",
    "neuronx_distributed.utils.batch_utils:get_batch_on_this_context_parallel_rank",
    "neuronx_distributed.utils.model_utils:init_on_device",
    "neuronx_distributed.utils.model_utils:is_hf_pretrained_model",
    "neuronx_distributed.utils.model_utils:is_hf_transformers_available",
    "neuronx_distributed.utils.model_utils:preserve_parallel_attributes",
    "neuronx_distributed.utils.model_utils:reinit_model",
    "neuronx_distributed.parallel_layers.layers:create_local_weight",
    "neuronx_distributed.parallel_layers.utils:cast_if_autocast_enabled",
    "neuronx_distributed.parallel_layers.utils:move_all_tensor_to_cpu",
    "neuronx_distributed.parallel_layers.parallel_state:get_context_model_parallel_src_tgt_pairs",
    "neuronx_distributed.modules.lora:get_lora_model",
    "neuronx_distributed.overrides.transformer_overrides:apply_rotary_pos_emb",
    "neuronx_distributed.overrides.transformer_overrides:rotate_half",
]


@pytest.mark.parametrize("nxd_path", COMPAT_DEFINED)
def test_compat_helper_resolves(nxd_path: str) -> None:
    assert callable(resolve(nxd_path))


def test_requires_init_pg_override_follows_nxds_rule() -> None:
    from neuronx_distributed.parallel_layers.utils import requires_init_pg_override

    # NxD: process groups need its override on torch 2.0 only
    assert requires_init_pg_override() is torch.__version__.startswith("2.0")


def test_parallel_layers_bases_for_isinstance_checks() -> None:
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import layers

    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear, GQAQKVColumnParallelLinear):
        assert issubclass(cls, layers.BaseParallelLinear)
    for cls in (layers.OutputChannelParallelConv2d, layers.InputChannelParallelConv2d):
        assert issubclass(cls, torch.nn.Module)
        assert not issubclass(cls, layers.BaseParallelLinear)  # NxD: a separate conv base


# NxD's parameters --------------------------------------------------------------------------
def _accepted(target: str, signature: inspect.Signature) -> set[str]:
    names = set(signature.parameters)
    if target.endswith("NxDPPModel.__init__"):
        from nxd_pipeline import XLA_RUNTIME_OPTIONS  # accepted through **kwargs

        names |= XLA_RUNTIME_OPTIONS
    return names


@pytest.mark.parametrize("target", sorted(SIG.SIGNATURES))
def test_nxd_parameter_names_defaults_and_order(target: str) -> None:
    stub, positional = SIG.SIGNATURES[target]
    nxd_params = list(inspect.signature(stub).parameters.values())
    signature = inspect.signature(resolve(target))
    params = [p for p in signature.parameters.values() if p.name != "self"]
    accepted = _accepted(target, signature)
    missing = [p.name for p in nxd_params if p.name not in accepted]
    assert not missing, f"NxD parameters {missing} are not accepted"
    for i, theirs in enumerate(nxd_params[:positional]):
        assert params[i].name == theirs.name, f"position {i}: {params[i].name}, NxD's {theirs}"
        assert params[i].kind is params[i].POSITIONAL_OR_KEYWORD, theirs.name
    for theirs in nxd_params:
        if theirs.name not in signature.parameters or theirs.default in (theirs.empty, SIG.ANY):
            continue  # accepted through **kwargs; no NxD default; see _nxd_signatures
        mine = signature.parameters[theirs.name].default
        assert mine == theirs.default, f"{theirs.name}: default {mine!r}, NxD's {theirs.default!r}"


def test_lora_config_has_nxds_fields_and_defaults() -> None:
    from neuronx_distributed.modules.lora import LoraConfig

    fields = {f.name: f for f in dataclasses.fields(LoraConfig)}
    for name, default in SIG.LORA_CONFIG_FIELDS.items():
        assert name in fields, name
        assert fields[name].default == default, name
    config = LoraConfig(enable_lora=True, merge_sharded_lora=True, target_modules=["q_proj"])
    assert config.merge_sharded_lora


def test_lora_targets_select_like_nxd() -> None:
    """NxD's rule: a list entry is an exact name or a '.'+entry suffix; a string is a regex."""
    from torch import nn

    from neuronx_distributed.modules.lora import LoraConfig, get_lora_model

    def block() -> nn.Module:
        model = nn.Module()
        model.attn = nn.Module()
        model.attn.q_proj, model.attn.v_proj = nn.Linear(4, 4), nn.Linear(4, 4)
        model.attn_q_proj = nn.Linear(4, 4)
        return model

    by_list = get_lora_model(block(), LoraConfig(enable_lora=True, target_modules=["q_proj"]))
    assert by_list.lora_module_names == ["attn.q_proj"]  # not attn_q_proj (no substring match)
    regex = LoraConfig(enable_lora=True, target_modules=r".*\.(q|v)_proj")
    assert get_lora_model(block(), regex).lora_module_names == ["attn.q_proj", "attn.v_proj"]
