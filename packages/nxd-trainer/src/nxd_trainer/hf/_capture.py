"""Forwards that communicate, while a pipeline captures the model with ``torch.export``.

At PP > 1 nxd-pipeline captures a Hugging Face model by running it once on fake tensors
(``torch.export``, non-strict) and then replaces each decoder layer's recorded operations by
one call of the layer, run eagerly in its stage. A layer holding an expert-parallel experts
module or context-parallel attention would, in that capture, run collectives on fake tensors
and data-dependent dispatch (``int(count)``), which ``torch.export`` cannot trace; yet what it
computes there is discarded. So while :func:`capturing`, such a module returns
:func:`stand_in`: a tensor of the output's shape and dtype,

    y = Eager(x)        with Eager the identity,

``Eager`` being a custom autograd Function: nxd-pipeline's capture keeps every module that
applies one as a module call (or fails), so the stand-in can never be inlined into a stage
graph and run instead of the real forward.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["capturing", "stand_in"]


def capturing() -> bool:
    """Whether ``torch.export`` is tracing the running forward."""
    return bool(torch.compiler.is_exporting())


class _Eager(torch.autograd.Function):
    """``y = x`` (a copy), gradient ``dL/dx = dL/dy``; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        del ctx
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        del ctx
        return grad


def stand_in(like: torch.Tensor) -> torch.Tensor:
    """The placeholder output (``like``'s shape and dtype) of a module whose real forward runs
    only eagerly; see the module docstring."""
    out: torch.Tensor = _Eager.apply(like)
    return out
