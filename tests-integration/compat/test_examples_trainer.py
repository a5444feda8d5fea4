"""NxD's trainer-API Llama examples, their calls rendered unchanged but for XLA, on gloo.

``tp_zero1_llama_hf_pretrain``: ``neuronx_distributed_config`` with ZeRO-1, an int
``sequence_parallel`` flag, selective checkpointing of ``CoreAttention``, meta-device init with
the example's ``init_weights`` (which replaces the rotary embeddings) and
``initialize_parallel_model(nxd_config, get_model, include_buffers, flags)`` with
``include_buffers=True`` passed positionally; ``AdamW_FP32OptimParams`` over NxD's
decay/no-decay groups; the loss averaged over DP with an all-reduce (``xm.all_reduce`` in the
example); ``optimizer.grad_norm``; a linear warmup schedule; ``save_checkpoint`` with its
positional arguments and ``num_kept_ckpts=-1`` (the example's default: keep all).

``tp_pp_llama_hf_pretrain``, at TP=2 x PP=2 and TP=1 x PP=2: the same model
(``return_dict=False``) under NxD's
``pipeline_config`` dict (``transformer_layer_cls``, ``output_loss_value_spec=(True, False)``,
``input_names``, ``auto_partition``, ``leaf_module_cls`` by class name, ``autowrap_modules``,
``use_optimizer_wrapper``, ``deallocate_pipeline_outputs``, ``fuse_microbatches``, the ZeRO-1
flag) and ``model.run_train(input_ids=..., attention_mask=..., labels=...)``; the model is
captured on the meta device, where its rotary embedding switches autocast off for
``x.device.type == "meta"``.

The ZeRO-1 script runs two steps at TP=2 x DP=2 and is compared with the same script at one
process (TP=1, no ZeRO-1): losses and gradient norms agree. Tolerance:
float32 throughout; the parallel runs sum the same products in another order (row-parallel
partial sums, the vocabulary-parallel log-sum-exp, DP/ZeRO-1 reductions, micro-batch means)
and AdamW's first step moves every weight by ~lr whatever the gradient's size, so step 2's loss
inherits the reordering: rtol 1e-4, atol 1e-5 (observed differences ~1e-6; a wrong shard,
scale or missing reduction moves the loss by >1e-2).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

M = load_sibling(__file__, "_nxd_hf_llama")
TOL = {"rtol": 1e-4, "atol": 1e-5}  # see the module docstring
STEPS, ROWS, SEED = 2, 4, 1234


def _batches(dp: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Each step's global batch of ROWS sequences; this DP rank's rows of it."""
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(1, M.VOCAB, (ROWS, M.SEQ), generator=gen)
        rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
        ids = ids[rows]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def get_model(flags: Any) -> torch.nn.Module:
    """The example's ``get_model(flags)``."""
    config = M.tiny_config()
    config.use_cache = False
    if flags.num_layers > 0:
        config.num_hidden_layers = flags.num_layers
    return M.LlamaForCausalLM(config)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    no_decay = ["bias", "LayerNorm"]
    return [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]  # fmt: skip


def train_llama_zero1(tp: int, use_zero_1: bool, checkpoint_dir: str | None) -> dict[str, Any]:
    """The pretraining script's calls (``train_llama(flags)``), XLA calls replaced."""
    import torch.distributed as dist
    from transformers import set_seed
    from transformers.optimization import get_linear_schedule_with_warmup

    import neuronx_distributed as nxd
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.utils.adamw_fp32_optim_params import AdamW_FP32OptimParams

    flags = SimpleNamespace(num_layers=-1, lr=1e-3, weight_decay=0.01, num_kept_checkpoint=-1)
    set_seed(SEED)
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        optimizer_config={"zero_one_enabled": use_zero_1, "grad_clipping": True,
                          "max_grad_norm": 1.0},
        sequence_parallel=0,  # the example's int flag (--use_sequence_parallel 0)
        activation_checkpoint_config=M.CoreAttention,
        model_init_config={"meta_device_init": True, "param_init_fn": M.init_weights},
        mixed_precision_config={"use_master_weights": True, "use_fp32_grad_acc": True,
                                "use_master_weights_in_ckpt": False},
    )  # fmt: skip
    include_buffers = True
    model = nxd.initialize_parallel_model(nxd_config, get_model, include_buffers, flags)
    # The rotary tables were built on meta (include_buffers) and recomputed by init_weights.
    assert not any(b.is_meta for b in model.buffers())
    world_size = parallel_state.get_data_parallel_size()
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config,
        AdamW_FP32OptimParams,
        _param_groups(model, flags.weight_decay),
        lr=flags.lr,
        betas=(0.9, 0.999),
        weight_decay=flags.weight_decay,
    )
    optimizer.zero_grad()
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=1, num_training_steps=10, last_epoch=-1
    )
    losses, norms = [], []
    batches = _batches(world_size, parallel_state.get_data_parallel_rank())
    for global_step, data in enumerate(batches, start=1):
        outputs = model(
            input_ids=data["input_ids"],
            attention_mask=data["attention_mask"],
            labels=data["labels"],
        )
        loss = outputs.loss
        loss.backward()
        running_loss = loss.detach() / world_size
        dist.all_reduce(running_loss, group=parallel_state.get_data_parallel_group())
        optimizer.step()
        total_norm = optimizer.grad_norm  # global norm before clipping
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(running_loss))
        norms.append(float(total_norm))
        if checkpoint_dir is not None:
            nxd.save_checkpoint(
                checkpoint_dir,  # checkpoint directory
                f"step_{global_step}",  # tag
                model,  # model
                optimizer,  # optimizer
                scheduler,  # scheduler
                {"epoch": 0, "global_step": global_step, "cli_args": vars(flags)},
                8,  # num_workers
                True,  # use_xser
                flags.num_kept_checkpoint,  # num_kept_ckpts: -1 keeps every tag
            )
    resumed = None
    if checkpoint_dir is not None:
        tag = None if nxd.has_checkpoint(checkpoint_dir) else "-1"
        user_content = nxd.load_checkpoint(
            checkpoint_dir, tag=tag, model=model, optimizer=optimizer, scheduler=scheduler
        )
        resumed = user_content["global_step"]
    return {"losses": losses, "norms": norms, "resumed": resumed}


def train_llama_pp(tp: int, pp: int, use_zero1_optimizer: bool) -> dict[str, Any]:
    """The TP+PP script's calls, XLA calls replaced."""
    import neuronx_distributed as nxd
    from neuronx_distributed.parallel_layers import mappings, parallel_state

    torch.manual_seed(SEED)
    config = M.tiny_config()
    config.use_cache = False
    config.return_dict = False
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config={
            "transformer_layer_cls": M.LlamaDecoderLayer,
            "num_microbatches": 2,
            "output_loss_value_spec": (True, False),
            "input_names": ["input_ids", "attention_mask", "labels"],
            "virtual_pipeline_size": 1,
            "auto_partition": True,
            "trace_file_path": None,
            "param_init_fn": None,
            "leaf_module_cls": [M.LlamaRMSNorm.__name__],
            "autowrap_modules": [mappings],
            "use_zero1_optimizer": use_zero1_optimizer,
            "use_optimizer_wrapper": True,
            "deallocate_pipeline_outputs": True,
            "fuse_microbatches": False,
        },
        optimizer_config={"zero_one_enabled": use_zero1_optimizer, "grad_clipping": True,
                          "max_grad_norm": 1.0},
        sequence_parallel=0,
        activation_checkpoint_config="full",
        model_init_config={"meta_device_init": True, "param_init_fn": M.init_weights},
        mixed_precision_config={"use_master_weights": True, "use_fp32_grad_acc": True,
                                "use_master_weights_in_ckpt": False},
    )  # fmt: skip

    def get_model(config: Any) -> torch.nn.Module:
        return M.LlamaForCausalLM(config)

    include_buffers = True
    model = nxd.initialize_parallel_model(nxd_config, get_model, include_buffers, config)
    _same_weights_at_any_layout(model)  # (the test's: NxD's init draws per rank)
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, _param_groups(model, 0.01), lr=1e-3, weight_decay=0.01
    )
    losses, norms, grads = [], [], {}
    for step, batch in enumerate(_batches(1, 0)):
        loss = model.run_train(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
        if step == 0:
            grads = _full_gradients(model)
        optimizer.step()
        norms.append(float(optimizer.grad_norm))
        optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    last = parallel_state.get_pipeline_model_parallel_rank() == pp - 1
    return {"losses": losses, "norms": norms, "last_stage": last, "grads": grads}


def _named(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters under the original model's names."""
    named = getattr(model, "local_named_parameters", model.named_parameters)()
    return [(n.removeprefix("module."), p) for n, p in named]


@torch.no_grad()
def _same_weights_at_any_layout(model: torch.nn.Module) -> None:
    """Every weight drawn from its own name, sharded as its TP attributes say.

    NxD's (and nxd's) meta-device init draws each rank's parameters from the RNG in the order
    that rank materialises them, so a pipeline rank, holding only its stage, draws other values
    than one process holding every layer; the parity check needs the same model in both.
    """
    import zlib

    from neuronx_distributed.parallel_layers import parallel_state
    from nxd_layers import shard_for_rank

    rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_size()
    for name, param in _named(model):
        sharded = getattr(param, "tensor_model_parallel", False)
        dim, stride = getattr(param, "partition_dim", -1), getattr(param, "partition_stride", 1)
        shape = list(param.shape)
        if sharded:
            shape[dim] *= tp
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full = torch.randn(shape, generator=gen) * (0.1 if param.dim() == 1 else 0.05)
        full += 1.0 if param.dim() == 1 else 0.0  # norm weights near 1
        param.copy_(shard_for_rank(full, dim, rank, tp, stride) if sharded else full)


def _full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameter gradients, TP shards gathered into the full tensor."""
    from nxd_layers import full_tensor

    return {name: full_tensor(p, p.grad) for name, p in _named(model) if p.grad is not None}


@pytest.mark.slow  # ~60-80 s on 2 shared cores: 4 + 1 ranks, two checkpoint saves and a load
def test_trainer_api_llama_tp_zero1_matches_one_process(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpts")
    parallel = run_distributed(train_llama_zero1, 4, 2, True, folder)
    (reference,) = run_distributed(train_llama_zero1, 1, 1, False, None)
    for result in parallel:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
        torch.testing.assert_close(result["norms"], reference["norms"], **TOL)
        assert result["resumed"] == STEPS  # the newest complete tag was loaded
    assert reference["losses"][1] < reference["losses"][0]  # it trained
    # num_kept_ckpts=-1 kept every tag
    assert sorted(p.name for p in Path(folder).iterdir() if p.is_dir()) == ["step_1", "step_2"]


@pytest.mark.slow  # ~30-90 s on 2 shared cores: four ranks capture the model, two steps
@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (1, 2)])
def test_trainer_api_llama_tp_pp_matches_one_process(tp: int, pp: int) -> None:
    # The example's LlamaForCausalLM.forward applies parallel_cross_entropy itself: captured
    # by torch.export, it is an operator whose registered backward the stage graph keeps.
    parallel = run_distributed(train_llama_pp, tp * pp, tp, pp, tp > 1)
    (reference,) = run_distributed(train_llama_pp, 1, 1, 1, False)
    held = [r for r in parallel if r["last_stage"]]
    assert len(held) == tp  # the TP ranks of the last stage hold the loss
    for result in held:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
    seen: set[str] = set()
    for result in parallel:
        torch.testing.assert_close(result["norms"], reference["norms"], **TOL)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], **TOL, msg=name)
            seen.add(name)
    assert seen == set(reference["grads"])  # every gradient compared, by some stage
