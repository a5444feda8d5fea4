"""``scale_gradients(1/k)`` after k accumulated micro-batches equals one batch k times larger.

DP=2, k = 4 micro-batches of 2 rows per rank against one batch of 8 rows per rank (the same
16 rows per step), 3 steps, clipping on with max_grad_norm = 1.5, for the plain wrapper and
ZeRO-1, each in fp32, in bf16 with fp32 master weights (gradients accumulate in bf16 ``p.grad``)
and in bf16 with ``use_fp32_grad_acc`` (fp32 accumulators, ``p.grad`` None). After every step
the accumulated run's ``grad_norm``, parameters (and fp32 masters) equal the large batch's, and
its optimizer state (``state_dict()``) after the last step.

The mean gradient's norm N is 0.65-0.87 here: N < 1.5 < k·N at every step (asserted), so the
correct runs are not clipped while a gradient left unscaled (k·N) would be: a missed scale
shows as a k-times norm and a clipped, different update. Checked by hand: with
``scale_gradients`` a no-op every case fails at the first step's norm, and the masters, the
params (fp32 from the second step: AdamW's first step is nearly scale-free) and the state
fail on their own (fp32 masters off by 1.1e-3, bf16 by 0.04-0.07, bf16 momentum by
0.25-0.34); scaling ``p.grad`` only fails both fp32-accumulation cases.

Tolerances:

* fp32 (AdamW, lr 1e-2): (1/k)·Σ_i mean(micro-batch i) re-associates the large batch's mean
  (1/k is a power of two, exact), a few ulps per gradient element; Adam keeps that relative:
  rtol 1e-5 / atol 1e-6 (measured 1.2e-7 on params, 4e-9 on the state).
* bf16 (SGD, lr 0.1, momentum 0.9, whose update is linear in the gradient, so a gradient
  bound carries over; Adam's g/√v could turn a rounding difference in a near-zero gradient
  element into a whole lr-sized step). Each gradient element of the accumulated run carries
  the bf16 rounding of k micro-batch gradients and of the k - 1 sums in bf16 ``p.grad`` (or
  none with fp32 accumulation), the large batch's carries one, both one more in the bf16 DP
  mean: |Δg| <= (k + 2)·2^-9·G per step, G ≈ 0.45 the largest gradient element (measured),
  2^-9 half a bf16 ulp, which also covers the next steps' forward on params one rounding
  apart. The momentum buffer after 3 steps sums g_3 + 0.9 g_2 + 0.81 g_1: |Δ| <= 2.71·|Δg|;
  the masters move by lr·(b_1 + b_2 + b_3): |Δ| <= 0.1·(1 + 1.9 + 2.71)·|Δg|; the bf16 params
  are the masters rounded, one ulp more (rtol 2^-7); the norm is within (k + 2)·2^-9 relative.
  Measured: masters 3.0e-4 (bound 3.3e-3), momentum 1.4e-3 (bound 1.6e-2), norm 5.7e-4
  relative (bound 1.2e-2), params one bf16 ulp (3.9e-3 at |θ| in [0.5, 1)).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nxd_state
from nxd_optim import MixedPrecisionConfig, NeuronZero1Optimizer, NxDOptimizer, OptimizerConfig
from nxd_state.testing import run_distributed

K = 4  # micro-batches per step
STEPS = 3
ROWS = 16  # per step, over both DP ranks
MAX_NORM = 1.5  # between the mean gradient's norm N and k·N (see the module docstring)

FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
_G = 0.5  # bounds the largest gradient element (0.45 measured)
_DG = (K + 2) * 2**-9 * _G  # bf16: per-step bound on a gradient element's difference
BF16_TOL = {
    "norm": {"rtol": (K + 2) * 2**-9, "atol": 0.0},
    "state": {"rtol": 0.0, "atol": 2.71 * _DG},
    "master": {"rtol": 0.0, "atol": 0.1 * (1 + 1.9 + 2.71) * _DG},
    "param": {"rtol": 2**-7, "atol": 0.1 * (1 + 1.9 + 2.71) * _DG},
}

CASES = [  # (zero_one_enabled, param dtype, use_fp32_grad_acc)
    (zero, dtype, acc)
    for zero in (False, True)
    for dtype, acc in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True))
]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))
    return model.to(dtype)


def _optimizer(model: nn.Module, zero: bool, acc: bool) -> NxDOptimizer:
    config = OptimizerConfig(zero_one_enabled=zero, max_grad_norm=MAX_NORM)
    mixed = MixedPrecisionConfig(use_master_weights=True, use_fp32_grad_acc=acc)
    params = list(model.parameters())
    if params[0].dtype == torch.float32:
        return NxDOptimizer(
            params, torch.optim.AdamW, config=config, mixed_precision=mixed, lr=1e-2,
            weight_decay=0.1,
        )  # fmt: skip
    return NxDOptimizer(
        params, torch.optim.SGD, config=config, mixed_precision=mixed, lr=0.1, momentum=0.9,
        weight_decay=0.1,
    )  # fmt: skip


def _masters(opt: NxDOptimizer) -> list[torch.Tensor]:
    """What the inner optimizer steps: fp32 masters (per param, or ZeRO-1's flat shards)."""
    if isinstance(opt.optimizer, NeuronZero1Optimizer):
        return [b.master.detach().clone() for b in opt.optimizer.dtype_buckets]
    return [p.detach().clone() for group in opt.param_groups for p in group["params"]]


def _tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of an optimizer state dict's ``state``, in key order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    return []


def _train(zero: bool, dtype: torch.dtype, acc: bool, micro_batches: int) -> dict[str, Any]:
    """3 steps on this rank's 8 rows, as ``micro_batches`` backward passes (then scaled)."""
    state = nxd_state.get_parallel_state()
    model = _model(dtype)
    opt = _optimizer(model, zero, acc)
    steps = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(200 + step)
        x, y = torch.randn(ROWS, 7, generator=gen), torch.randn(ROWS, 5, generator=gen)
        x = x.chunk(state.data_parallel_size)[state.data_parallel_rank]
        y = y.chunk(state.data_parallel_size)[state.data_parallel_rank]
        opt.zero_grad()
        for mx, my in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            nn.functional.mse_loss(model(mx.to(dtype)).float(), my).backward()
        if acc:  # the sums wait in fp32 buffers, not in p.grad
            assert all(p.grad is None for p in model.parameters())
        with nxd_state.count_collectives() as counted:
            opt.scale_gradients(1 / micro_batches)
        assert counted.stats == {}, "scale_gradients must not communicate"
        opt.step()
        steps.append(
            {
                "norm": opt.grad_norm.clone(),
                "params": [p.detach().float().clone() for p in model.parameters()],
                "masters": _masters(opt),
            }
        )
    return {"steps": steps, "state": _tensors(opt.state_dict()["state"])}


def _compare(zero: bool, dtype: torch.dtype, acc: bool) -> list[float]:
    accumulated, large = _train(zero, dtype, acc, K), _train(zero, dtype, acc, 1)
    bf16 = dtype == torch.bfloat16
    tol = BF16_TOL if bf16 else dict.fromkeys(("norm", "state", "master", "param"), FP32_TOL)
    norms = []
    for step, (got, want) in enumerate(zip(accumulated["steps"], large["steps"])):
        where = f"zero={zero} {dtype} fp32_grad_acc={acc} step {step}"
        norm = float(want["norm"])
        assert norm < MAX_NORM < K * norm, f"{where}: N={norm} does not discriminate"
        norms.append(norm)
        torch.testing.assert_close(got["norm"], want["norm"], **tol["norm"], msg=where)
        for a, b in zip(got["masters"], want["masters"], strict=True):
            torch.testing.assert_close(a, b, **tol["master"], msg=where)
        for a, b in zip(got["params"], want["params"], strict=True):
            torch.testing.assert_close(a, b, **tol["param"], msg=where)
    assert len(accumulated["state"]) == len(large["state"]) > 0
    for a, b in zip(accumulated["state"], large["state"]):
        torch.testing.assert_close(a, b, **tol["state"], msg=f"zero={zero} {dtype} {acc} state")
    return norms


def _edges() -> None:
    """No allocation without gradients, 1.0 is a no-op, a non-finite factor is refused."""
    for zero in (False, True):
        model = _model(torch.float32)
        opt = _optimizer(model, zero, acc=False)
        opt.scale_gradients(0.5)  # before any backward: nothing to scale, nothing allocated
        assert all(p.grad is None for p in model.parameters())
        nn.functional.mse_loss(model(torch.ones(2, 7)), torch.zeros(2, 5)).backward()
        before = [p.grad.clone() for p in model.parameters()]
        opt.scale_gradients(1.0)  # a no-op
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
        opt.scale_gradients(0.25)
        assert all(torch.equal(p.grad, g / 4) for p, g in zip(model.parameters(), before))
        for bad in (math.nan, math.inf):
            name = "NeuronZero1Optimizer" if zero else "NxDOptimizer"
            with pytest.raises(ValueError, match=rf"{name}\.scale_gradients: factor must be a "):
                opt.scale_gradients(bad)


def _suite() -> list[list[float]]:
    nxd_state.initialize_model_parallel()
    _edges()
    return [_compare(zero, dtype, acc) for zero, dtype, acc in CASES]


def test_scale_gradients_by_one_over_k_equals_the_k_times_larger_batch() -> None:
    results = run_distributed(_suite, 2)
    assert results[0] == results[1]  # both ranks saw the same (global) norms
