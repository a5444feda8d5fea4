"""``max_grad_norm = math.inf`` (clipping on): the norm is measured, the gradients not scaled.

DP=2, 3 steps of SGD with momentum, for ``NxDOptimizer`` (plain and ZeRO-1, from an
``OptimizerConfig``) and ``NeuronZero1Optimizer`` itself with both gradient reductions (the
reduce-scatter one sums its shards' norms over DP). The loss is scaled by 10 so ‖g‖ ≈ 8:
clipping to any norm below it (the default 1.0 included) would change the update. Against a
twin run with ``grad_clipping=False`` on the same data:

* ``grad_norm`` equals ``torch.nn.utils.get_total_norm`` of the DP-averaged gradients
  (all-reduced by the test before the step), within fp32 rounding: the same per-param norms
  combined in another order, and ZeRO-1 takes ‖Σ_r g_r‖ / n instead of ‖(1/n) Σ_r g_r‖
  (n = 2, exact): rtol 1e-6;
* the parameters equal the unclipped run's bitwise: nothing multiplies the gradients.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

import nxd_state
from nxd_optim import MixedPrecisionConfig, NeuronZero1Optimizer, NxDOptimizer, OptimizerConfig
from nxd_state.testing import run_distributed

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))


def _optimizer(model: nn.Module, kind: str, clipping: bool) -> torch.optim.Optimizer:
    """``kind``: "plain" / "zero1" (NxDOptimizer), or a reduction for NeuronZero1Optimizer."""
    hyper = {"lr": 0.05, "momentum": 0.9}
    if kind in ("plain", "zero1"):
        config = OptimizerConfig(
            zero_one_enabled=kind == "zero1", grad_clipping=clipping, max_grad_norm=math.inf
        )
        # Gradients stay in p.grad (not ZeRO-1's default fp32 accumulators): the test reads
        # them there for the reference norm.
        mixed = MixedPrecisionConfig(use_fp32_grad_acc=False)
        return NxDOptimizer(
            model.parameters(), torch.optim.SGD, config=config, mixed_precision=mixed, **hyper
        )
    return NeuronZero1Optimizer(
        list(model.parameters()),
        torch.optim.SGD,
        grad_clipping=clipping,
        max_norm=math.inf,
        grad_reduction=kind,
        **hyper,
    )


def _averaged_grads(model: nn.Module) -> list[torch.Tensor]:
    """(1/n) Σ_DP g of every param, gathered here, as the reference's gradients."""
    group = nxd_state.get_parallel_state().data_parallel_group
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad, group=group)
        grad.div_(dist.get_world_size(group))
    return grads


def _compare(kind: str) -> list[float]:
    state = nxd_state.get_parallel_state()
    measured = _model()
    unclipped = copy.deepcopy(measured)
    opt = _optimizer(measured, kind, clipping=True)
    twin = _optimizer(unclipped, kind, clipping=False)
    norms = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(300 + step)
        x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)
        x, y = x.chunk(2)[state.data_parallel_rank], y.chunk(2)[state.data_parallel_rank]
        for model, optimizer in ((measured, opt), (unclipped, twin)):
            optimizer.zero_grad()
            (10 * nn.functional.mse_loss(model(x), y)).backward()
        expected = torch.nn.utils.get_total_norm(_averaged_grads(measured))
        opt.step()
        twin.step()
        assert twin.grad_norm is None  # clipping off: nothing measured
        assert opt.grad_norm is not None
        torch.testing.assert_close(opt.grad_norm, expected, rtol=1e-6, atol=0.0, msg=kind)
        assert float(expected) > 1.0, "a clip to 1.0 must have changed the update"
        for p, q in zip(measured.parameters(), unclipped.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0.0, atol=0.0, msg=f"{kind} step {step}")
        norms.append(float(opt.grad_norm))
    return norms


def _suite() -> list[list[float]]:
    nxd_state.initialize_model_parallel()
    return [_compare(kind) for kind in ("plain", "zero1", "all_reduce", "reduce_scatter")]


def test_infinite_max_norm_measures_the_norm_and_clips_nothing() -> None:
    results = run_distributed(_suite, 2)
    assert results[0] == results[1]  # every rank reports the global norm
