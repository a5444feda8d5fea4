"""Gradient accumulation as a mean: G <- G / k before the optimizer step.

k micro-batches of one optimizer step each add their gradient: ``G = Σ_i ∇L_i``. The larger
batch's loss is their mean (equal micro-batch sizes), so its gradient is ``G / k``. Every
reduction between backward and step (the pipeline's tied-weight sum, the DP average) is linear,
so scaling the accumulated local gradient once before ``step()`` equals scaling each loss, and
works the same at PP = 1 and PP > 1 (where the pipeline runs the backward itself and the loss
cannot be scaled before it). Clipping, inside ``step()``, then sees the mean gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["scale_accumulated_gradients"]


def _accumulated(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list:
    """Where ``optimizer`` keeps the local gradients of ``params`` until its step."""
    from nxd_optim import NeuronZero1Optimizer, NxDOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, NxDOptimizer) else optimizer
    if isinstance(inner, NeuronZero1Optimizer):
        return inner.gradients()  # p.grad or its fp32 accumulator, editable in place
    if isinstance(optimizer, NxDOptimizer) and optimizer.config.use_fp32_grad_acc:
        # fp32 accumulation without ZeRO-1 keeps the sums in the wrapper's gradient store,
        # which nxd-optim exposes only privately (a public accessor is requested).
        return optimizer._store().grads([p for p in optimizer._params if p.requires_grad])
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def scale_accumulated_gradients(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], factor: float
) -> None:
    """Multiply the gradients accumulated for ``optimizer`` (over ``params``) by ``factor``."""
    for grad in _accumulated(optimizer, params):
        grad.mul_(factor)
