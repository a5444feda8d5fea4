"""NxDOptimizer under Lightning's ``LightningOptimizer``, which takes the wrapped optimizer's
class as a base and defines its own ``optimizer`` property: every call a training step makes
through ``self.optimizers()`` reaches the nxd optimizer, with and without ZeRO-1."""

from __future__ import annotations

import pytest

from nxd_state.testing import run_distributed


def _zero_grad_and_step_through_lightning(zero: bool) -> list[float]:
    import torch
    from lightning.pytorch.core.optimizer import LightningOptimizer

    import nxd_state
    from nxd_optim import MixedPrecisionConfig, NxDOptimizer, OptimizerConfig

    nxd_state.initialize_model_parallel()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    inner = NxDOptimizer(
        model.parameters(),
        torch.optim.SGD,
        config=OptimizerConfig(zero_one_enabled=zero),
        # Gradients stay in p.grad (not ZeRO-1's default fp32 accumulators), where the test
        # reads them to see zero_grad clear them.
        mixed_precision=MixedPrecisionConfig(use_fp32_grad_acc=False),
        lr=0.1,
    )
    optimizer = LightningOptimizer(inner)
    assert optimizer.optimizer is inner  # Lightning's property, not nxd's
    norms = []
    for _ in range(2):
        optimizer.zero_grad()  # NxDOptimizer.zero_grad, run on the LightningOptimizer
        model(torch.ones(2, 4)).sum().backward()
        inner.step()
        norms.append(float(inner.grad_norm))
    assert all(p.grad is None for p in model.parameters()) is False
    optimizer.zero_grad()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    return norms


@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero1"])
def test_nxd_optimizer_through_lightning_optimizer(zero: bool) -> None:
    (norms,) = run_distributed(_zero_grad_and_step_through_lightning, 1, zero)
    # d/dW sum(W x + b) is the same every step (x fixed): one norm, twice, nothing accumulated
    # across the zero_grad in between.
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
