"""Expert parallelism through :class:`NxDOptimizer`: a dense linear followed by the tiny MoE
block (hidden 16, 4 experts, top-2, dropless) trained 2 steps with AdamW and gradient
clipping at EP=2 with DP=2 (world 2) and DP=4 (world 4: expert-DP groups [0, 2] and [1, 3]),
against the same model trained in one process on the concatenated batch.

Each rank feeds its own rows of the batch (rank order = the one-process batch order), its loss
the mean over its own tokens. Compared on every rank after the two steps: every parameter
(expert weights against this rank's slice of the one-process experts), the loss averaged over
DP, and the gradient norm the optimizer clipped with (the one-process ``clip_grad_norm_``).
The optimizer state saved at EP=2 and loaded into a fresh optimizer continues bit-identically
(each EP rank's experts have their own state: one file per EP rank).

Tolerance: float64 everywhere; the parallel run computes the same products, only summed in
another order (the all-to-all regroups tokens, gradients are all-reduced), so losses and
gradients agree to a few ulps of float64 (1e-10 for the losses is far above that). The
clipping factor is the one place with less precision: ``get_grad_norm`` returns a float32
norm (its documented accumulator), so the factor carries float32 rounding (~6e-8 relative)
that the one-process ``clip_grad_norm_`` (float64) does not; it reaches the parameters through
the second step's AdamW update (the first is scale-invariant), measured at ~2e-8 relative. For
the parameters rtol 1e-6 / atol 1e-8 covers that and stays far below any real mistake: a
gradient averaged over the wrong group (another rank's experts mixed in, or an expert gradient
EP times too large) or a norm counting experts twice moves parameters by ~1e-3 (lr x a changed
direction or clip factor).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import nxd_state as ps
from nxd_layers.moe import ExpertMLPsCapacityFactor, MoE, RouterTopK
from nxd_optim import NxDOptimizer, OptimizerConfig
from nxd_state import collectives
from nxd_state.testing import run_distributed

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 16, 4, 2, 8
ROWS_PER_RANK, SEQ, STEPS = 2, 3, 2
MAX_NORM = 0.005  # below every step's gradient norm: clipping binds (asserted)
TOL = {"rtol": 1e-10, "atol": 1e-10}  # losses: float64, reordered sums (module docstring)
PARAM_TOL = {"rtol": 1e-6, "atol": 1e-8}  # float32 clip factor (module docstring)


class DenseThenMoE(nn.Module):
    """x -> Linear(16, 16) -> MoE (top-2 of 4 gated-SiLU experts, dropless)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same full weights at any EP degree (experts drawn full)
        self.dense = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        router = RouterTopK(EXPERTS, TOP_K, HIDDEN, dtype=torch.float64)
        experts = ExpertMLPsCapacityFactor(
            EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", None, True, dtype=torch.float64
        )
        self.moe = MoE(router, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe(self.dense(x))[0]
        return out


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    shape = (world * ROWS_PER_RANK, SEQ, HIDDEN)
    return [
        (
            torch.randn(shape, dtype=torch.float64, generator=gen),
            torch.randn(shape, dtype=torch.float64, generator=gen),
        )
        for _ in range(STEPS)
    ]


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rows: slice,
    clip: Callable[[], object],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """STEPS steps of mean-squared error on ``rows`` of each batch (``clip()`` between backward
    and step); the losses and the gradient norms (``clip()``'s, else the optimizer's)."""
    losses, norms = [], []
    for x, target in batches:
        optimizer.zero_grad()
        loss = ((model(x[rows]) - target[rows]) ** 2).mean()
        loss.backward()
        norm = clip()
        optimizer.step()
        norms.append(norm if isinstance(norm, torch.Tensor) else optimizer.grad_norm)  # type: ignore[attr-defined]
        losses.append(loss.detach())
    return losses, norms


def ep_training_parity(world: int) -> None:
    """Runs on each of ``world`` ranks (EP = 2, DP = world); asserts parity."""
    batches = _batches(world)
    # One process, the whole batch (built before any parallel state: every expert here).
    ref = DenseThenMoE()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_params = list(ref.parameters())

    def ref_norm() -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM)

    ref_losses, ref_norms = _train(ref, ref_opt, batches, slice(None), ref_norm)
    assert all(float(n) > MAX_NORM for n in ref_norms)  # clipping really scales

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model = DenseThenMoE()
    config = OptimizerConfig(grad_clipping=True, max_grad_norm=MAX_NORM)
    opt = NxDOptimizer(
        model.parameters(), torch.optim.AdamW, config=config, lr=1e-2, weight_decay=0.1
    )
    rank = ps.get_data_parallel_rank()
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    losses, norms = _train(model, opt, batches, rows, lambda: None)  # NxDOptimizer clips

    dp_group = ps.get_data_parallel_group()
    for loss, expected in zip(losses, ref_losses, strict=True):
        mean = collectives.all_reduce(loss.clone(), dp_group) / world  # equal-sized slices
        torch.testing.assert_close(mean, expected, **TOL)
    # The last step's norm (float32: get_grad_norm's accumulator; relative 1e-6 covers it).
    torch.testing.assert_close(norms[-1], ref_norms[-1].to(torch.float32), rtol=1e-6, atol=0.0)
    ep_rank, local = ps.get_expert_model_parallel_rank(), EXPERTS // 2
    mine = slice(ep_rank * local, (ep_rank + 1) * local)
    reference = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        expected = reference[name]
        if getattr(param, "expert_model_parallel", False):
            expected = expected[mine]
        torch.testing.assert_close(param, expected, **PARAM_TOL, msg=lambda m, n=name: f"{n}: {m}")
    ps.destroy_model_parallel()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_training_equals_one_process(world: int) -> None:
    run_distributed(ep_training_parity, world, world)


def ep_save_load(world: int, directory: str) -> None:
    """One step, save, a fresh model and optimizer load (params and optimizer state); the next
    step equals the run that went on (bit-identical: the same state, the same arithmetic)."""
    first, second = _batches(world)
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    rank = ps.get_data_parallel_rank()
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    config = OptimizerConfig(grad_clipping=True, max_grad_norm=MAX_NORM)

    def build() -> tuple[nn.Module, NxDOptimizer]:
        model = DenseThenMoE()
        opt = NxDOptimizer(
            model.parameters(), torch.optim.AdamW, config=config, lr=1e-2, weight_decay=0.1
        )
        return model, opt

    model, opt = build()
    _train(model, opt, [first], rows, lambda: None)
    opt.save_sharded_state_dict(directory)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, [second], rows, lambda: None)

    resumed, resumed_opt = build()
    resumed.load_state_dict(weights)
    resumed_opt.load_sharded_state_dict(directory)
    _train(resumed, resumed_opt, [second], rows, lambda: None)
    for (name, param), other in zip(model.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(other, param, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    ps.destroy_model_parallel()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_optimizer_state_round_trip(world: int, tmp_path: object) -> None:
    run_distributed(ep_save_load, world, world, str(tmp_path))
