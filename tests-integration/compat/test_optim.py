"""ZeRO-1 and clipping the NxD way (TP=2 x DP=2 on 4 gloo ranks) equal one process.

The pattern of NxD's gradient-clipping integration test: a ``ColumnParallelLinear`` with
``keep_master_weight=True`` and its full twin, gradients set directly on the shards (TP rows
sliced, the replicated bias whole), ``NeuronZero1Optimizer`` with ``sharding_groups`` /
``grad_norm_groups`` as replica groups, ``max_norm`` and ``grad_clipping=True``, then
``optimizer.grad_norm`` against ``torch.nn.utils.clip_grad_norm_`` of the full gradients. Here
the parameter groups are NxD's decay / no-decay split and mix dtypes (a bf16 linear, an fp32
norm), the two DP ranks get different gradients, and two AdamW steps must give the parameters
of one process stepping fp32 master copies with the DP-averaged, clipped gradients.

``clip_grad_norm`` / ``get_grad_norm`` with NxD's ``zero1_optimizer`` / ``zero1_optimizer_groups``
are checked on gradient pieces laid out as ZeRO-1 lays them (each (TP, DP) rank a disjoint part).

Tolerances: the gradients are multiples of 1/8 below 2 in magnitude, exact in bf16, and their DP
average is exact too, so the only differences are float32 summation order in the norm (rtol
1e-6) and its effect on the clip factor and AdamW's update (fp32 masters: rtol 1e-5, atol 1e-7);
bf16 params are those masters rounded, which can land one bf16 ulp apart (rtol 2^-8).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nxd_state.testing import run_distributed, run_named_checks

TP, DP = 2, 2
MAX_NORM, LR, STEPS = 1.0, 1e-2, 2
NORM_TOL = {"rtol": 1e-6, "atol": 0.0}
FP32_TOL = {"rtol": 1e-5, "atol": 1e-7}
BF16_TOL = {"rtol": 2**-8, "atol": 1e-7}
ZERO1 = "ZeRO-1 + clipping, mixed bf16/fp32 groups"
CLIP = "clip_grad_norm / get_grad_norm with zero1 args"


def _grads(dp_rank: int, step: int) -> dict[str, torch.Tensor]:
    """Full gradients of (weight (8, 8), bias (8,), norm weight, norm bias) for one DP rank:
    multiples of 1/8 in [-2, 2] (exact in bf16)."""
    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    shapes = {"weight": (8, 8), "bias": (8,), "norm.weight": (8,), "norm.bias": (8,)}
    return {k: torch.randint(-16, 17, s, generator=gen).float() / 8 for k, s in shapes.items()}


def _groups(params: dict[str, torch.Tensor]) -> list[dict]:
    """NxD's decay / no-decay groups; each mixes the bf16 linear and the fp32 norm."""
    return [
        {"params": [params["weight"], params["norm.weight"]], "weight_decay": 0.01},
        {"params": [params["bias"], params["norm.bias"]], "weight_decay": 0.0},
    ]


def check_zero1_steps(tp_rank: int, dp_rank: int) -> None:
    from neuronx_distributed.optimizer import NeuronZero1Optimizer
    from neuronx_distributed.parallel_layers import ColumnParallelLinear, parallel_state

    layer = ColumnParallelLinear(8, 8, keep_master_weight=True, dtype=torch.bfloat16)
    norm = nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.add_(torch.randn(8) * 0.1)  # same on every rank: one seed
    full_weight = layer.master_weight.to(torch.bfloat16).float()
    torch.testing.assert_close(layer.weight.float(), full_weight.chunk(TP)[tp_rank], rtol=0, atol=0)
    params = {"weight": layer.weight, "bias": layer.bias}
    params |= {"norm.weight": norm.weight, "norm.bias": norm.bias}
    assert (layer.weight.dtype, layer.bias.dtype, norm.weight.dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )
    masters = {  # one process: fp32 copies of the full parameters
        "weight": full_weight,
        "bias": layer.bias.detach().float(),
        "norm.weight": norm.weight.detach().clone(),
        "norm.bias": norm.bias.detach().clone(),
    }
    masters = {k: v.clone().requires_grad_() for k, v in masters.items()}
    reference = torch.optim.AdamW(_groups(masters), lr=LR)
    optimizer = NeuronZero1Optimizer(
        _groups(params),
        torch.optim.AdamW,
        lr=LR,
        pin_layout=False,
        sharding_groups=parallel_state.get_data_parallel_replica_groups(),
        grad_norm_groups=parallel_state.get_tensor_model_parallel_replica_groups(),
        max_norm=MAX_NORM,
        grad_clipping=True,
    )
    assert isinstance(optimizer.base_optimizer, torch.optim.AdamW)  # torch-xla's attribute
    for step in range(STEPS):
        mine = _grads(dp_rank, step)
        for name, param in params.items():
            grad = mine[name].chunk(TP)[tp_rank] if name == "weight" else mine[name]
            param.grad = grad.to(param.dtype)
        optimizer.step()
        optimizer.zero_grad()
        every = [_grads(d, step) for d in range(DP)]
        for name, master in masters.items():
            master.grad = sum(g[name] for g in every) / DP
        ref_norm = torch.nn.utils.clip_grad_norm_(list(masters.values()), MAX_NORM)
        assert ref_norm > 2 * MAX_NORM  # the step clips
        reference.step()
        torch.testing.assert_close(optimizer.grad_norm, ref_norm, **NORM_TOL)
        with torch.no_grad():
            expected = dict(masters, weight=masters["weight"].chunk(TP)[tp_rank])
            for name, param in params.items():
                tol = BF16_TOL if param.dtype == torch.bfloat16 else FP32_TOL
                want = expected[name].to(param.dtype)
                torch.testing.assert_close(param, want, **tol, msg=lambda m, n=name: f"{n}: {m}")
    moved = (layer.weight.float() - full_weight.chunk(TP)[tp_rank]).abs().max()
    assert moved > 100 * BF16_TOL["atol"]  # the comparison can fail


def check_clip_grad_norm_zero1_args(tp_rank: int, dp_rank: int) -> None:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.grads import clip_grad_norm, get_grad_norm
    from neuronx_distributed.parallel_layers.utils import set_tensor_model_parallel_attributes

    full = _grads(0, 7)
    pieces, expected_rows = [], []
    for name, grad in full.items():
        sharded = name == "weight"
        local = grad.chunk(TP)[tp_rank] if sharded else grad
        piece = nn.Parameter(torch.zeros_like(local.chunk(DP)[dp_rank]))
        piece.grad = local.chunk(DP)[dp_rank].clone()
        if sharded:
            set_tensor_model_parallel_attributes(piece, True, 0, 1)
        pieces.append(piece)
        expected_rows.append((name, sharded))
    ref_params = [nn.Parameter(torch.zeros_like(g)) for g in full.values()]
    for param, grad in zip(ref_params, full.values()):
        param.grad = grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM)
    groups = parallel_state.get_data_parallel_replica_groups()
    world_norm = get_grad_norm(pieces, 2, zero1_optimizer=True)  # no groups: over the world
    torch.testing.assert_close(world_norm, want, **NORM_TOL)
    norm = clip_grad_norm(pieces, MAX_NORM, zero1_optimizer=True, zero1_optimizer_groups=groups)
    torch.testing.assert_close(norm, want, **NORM_TOL)
    for piece, ref, (name, sharded) in zip(pieces, ref_params, expected_rows):
        local = ref.grad.chunk(TP)[tp_rank] if sharded else ref.grad
        torch.testing.assert_close(piece.grad, local.chunk(DP)[dp_rank], **FP32_TOL, msg=name)
    # NxD: the groups belong to ZeRO-1; without it they are an error (raised before any collective)
    with pytest.raises(ValueError, match="zero1_optimizer"):
        get_grad_norm(pieces, zero1_optimizer_groups=groups)


def zero1_suite() -> list[str]:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.random import model_parallel_xla_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    model_parallel_xla_manual_seed(1234)
    return run_named_checks(
        {
            ZERO1: lambda: check_zero1_steps(tp_rank, dp_rank),
            CLIP: lambda: check_clip_grad_norm_zero1_args(tp_rank, dp_rank),
        },
        context=f"tp {tp_rank} dp {dp_rank}",
    )


def test_nxd_zero1_and_clipping_match_one_process() -> None:
    assert run_distributed(zero1_suite, TP * DP) == [[ZERO1, CLIP]] * (TP * DP)
