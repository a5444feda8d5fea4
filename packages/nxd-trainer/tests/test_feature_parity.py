"""Config features through the sample at TP=2, each equal to its one-process recipe and golden
curve: LoRA (``lora_config``), padded attention heads (``pad_model="head_aligned"``, 3 heads on
2 ranks; ``pad_model=True``, NxD's per-shard layout, is checked for its layout) and bf16
parameters with fp32 master weights (ZeRO-1's default mixed precision).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
# bf16 keeps 8 significant bits (relative rounding 2^-8 = 0.4%); TP rounds each partial matmul
# output to bf16 before summing and ZeRO-1 adds in another order, so activations and gradients
# differ by about an ulp; over 3 steps the losses agree to ~0.3% and weights to a couple of
# ulps. SGD, not Adam: Adam's first steps are ±lr whatever the gradient's size, so a gradient
# that is round-off in bf16 (an embedding row whose token contributions cancel) would move a
# weight by ±lr in either direction. This checks the recipe end to end and that the config
# turns fp32 masters on; that masters keep updates below a bf16 ulp is nxd-optim's test (at
# this tolerance and 3 steps, a run without masters is not told apart: measured).
BF16_TOL = {"rtol": 1e-2, "atol": 1e-3}
BF16_SGD = {"lr": 0.1}
LORA = {
    "enable_lora": True,
    "lora_rank": 4,
    "lora_alpha": 8.0,
    "target_modules": ["q_proj", "v_proj", "o_proj"],
}
PAD_MODEL = {"hidden": 24, "heads": 3}  # 3 heads do not split over 2 ranks without padding


def _fill_adapters(model: torch.nn.Module) -> None:
    """Deterministic adapter weights (B non-zero too), keyed by module name: the same in the
    one-process and the TP model."""
    from nxd_trainer.testing import deterministic_init

    for name, module in model.named_modules():
        if ".lora_" in name:
            module.init_key = 1000 + 7 * len(name) + sum(map(ord, name))
            deterministic_init(module)


def _reference(kind: str) -> dict[str, Any]:
    """The one-process recipe of each feature."""
    from nxd_lora import LoraConfig, LoRAModel

    model: torch.nn.Module
    if kind == "lora":
        model = LoRAModel(R.get_model(), LoraConfig(**LORA))
        _fill_adapters(model)
    elif kind == "pad":
        model = R.get_model(**PAD_MODEL)
    else:  # bf16 parameters, fp32 masters stepped by AdamW, clipping on fp32 gradients
        model = R.get_model().to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().requires_grad_() for p in params]
    optimizer: torch.optim.Optimizer
    if kind == "bf16":
        optimizer = torch.optim.SGD(masters, **BF16_SGD)
    else:
        optimizer = torch.optim.AdamW(masters, **R.ADAMW)
    losses = []
    for ids in R.batches():
        loss = model(ids, ids)
        loss.backward()
        for master, param in zip(masters, params):
            master.grad = param.grad.float()
            param.grad = None
        torch.nn.utils.clip_grad_norm_(masters, R.MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for master, param in zip(masters, params):
                param.copy_(master)
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _bf16_model(**kwargs: Any) -> torch.nn.Module:
    return R.get_model(**kwargs).to(torch.bfloat16)


def run_feature(kind: str) -> dict[str, Any]:
    import nxd_state
    import nxd_trainer as nxd
    from nxd_lora import LoraConfig

    nxd_state.destroy_model_parallel()
    zero1 = kind == "bf16"
    config: dict[str, Any] = {
        "tensor_parallel_size": 2,
        "optimizer_config": {"zero_one_enabled": zero1, "max_grad_norm": R.MAX_GRAD_NORM},
    }
    model_fn: Callable[..., torch.nn.Module] = R.get_model
    model_kwargs: dict[str, Any] = {"tensor_parallel": True}
    if kind == "lora":
        config["lora_config"] = LoraConfig(**LORA)
    elif kind in ("pad", "pad nxd layout"):
        config["pad_model"] = "head_aligned" if kind == "pad" else True
        model_kwargs.update(PAD_MODEL)
    else:
        model_fn = _bf16_model
    nxd_config = nxd.neuronx_distributed_config(**config)
    model = nxd.initialize_parallel_model(nxd_config, model_fn, **model_kwargs)
    state = nxd_state.get_parallel_state()
    if kind == "pad nxd layout":  # NxD's: each rank's own rows of Q, then zeros
        unpadded = R.get_model(tensor_parallel=True, **PAD_MODEL)
        mine = unpadded.blocks[0].attn.q_proj.weight
        padded = model.local_module().blocks[0].attn.q_proj.weight
        assert padded.shape[0] == 16  # 4 heads of 8 over 2 ranks
        assert torch.equal(padded[: mine.shape[0]], mine.detach())
        assert torch.count_nonzero(padded[mine.shape[0] :]) == 0
        return {}
    if kind == "lora":
        _fill_adapters(model.local_module())
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable, "LoRA left nothing trainable"
        assert all(".lora_" in n for n in trainable), trainable
    optimizer_class, hyper = (torch.optim.SGD, BF16_SGD) if zero1 else (torch.optim.AdamW, R.ADAMW)
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, optimizer_class, model.parameters(), **hyper
    )
    if kind == "bf16":  # ZeRO-1 with mixed_precision_config's defaults: fp32 masters
        assert nxd_config["mixed_precision_config"]["use_master_weights"] is True
        assert optimizer.mixed_precision.use_master_weights
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    losses = []
    for ids in R.batches():
        losses.append(float(model.run_train(ids, ids)))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": losses,
        "shards": R.local_shards(model),
        "tp": 2,
        "tp_rank": state.tensor_parallel_rank,
    }


def two_rank_features() -> dict[str, Any]:
    return {kind: run_feature(kind) for kind in ("lora", "pad", "pad nxd layout", "bf16")}


def _check_padded(results: list[dict[str, Any]], expected: dict[str, torch.Tensor]) -> None:
    """Gather each padded shard, keep the original heads' slice; the padding must be zero."""
    for name, full in expected.items():
        dim = results[0]["shards"][name][1]
        if dim is None:
            for result in results:
                torch.testing.assert_close(result["shards"][name][0], full, **R.TOL, msg=name)
            continue
        gathered = torch.cat([r["shards"][name][0] for r in results], dim=dim)
        kept = gathered.narrow(dim, 0, full.shape[dim])
        torch.testing.assert_close(kept, full, **R.TOL, msg=name)
        padding = gathered.narrow(dim, full.shape[dim], gathered.shape[dim] - full.shape[dim])
        assert torch.count_nonzero(padding) == 0, name


def test_lora_pad_and_bf16_masters_equal_their_one_process_recipes() -> None:
    per_rank = run_distributed(two_rank_features, 2)
    for kind, golden, tol in (
        ("lora", "tiny_lm_lora_adamw_clip", R.TOL),
        ("pad", "tiny_lm_3_heads_adamw_clip", R.TOL),
        ("bf16", "tiny_lm_bf16_masters_sgd_clip", BF16_TOL),
    ):
        expected = _reference(kind)
        results = [r[kind] for r in per_rank]
        for result in results:
            torch.testing.assert_close(
                torch.tensor(result["losses"]), torch.tensor(expected["losses"]), **tol
            )
        if kind == "pad":
            _check_padded(results, expected["params"])
        elif kind == "bf16":
            for result in results:
                for name, (value, dim) in result["shards"].items():
                    full = expected["params"][name]
                    if dim is not None:
                        full = full.chunk(2, dim=dim)[result["tp_rank"]]
                    torch.testing.assert_close(
                        value.float(), full.float(), **tol, msg=lambda m, n=name: f"{n}: {m}"
                    )
        else:
            R.check_params(results, expected["params"])
        torch.testing.assert_close(
            torch.tensor(expected["losses"]), torch.tensor(R.golden_losses(golden)), **tol
        )
