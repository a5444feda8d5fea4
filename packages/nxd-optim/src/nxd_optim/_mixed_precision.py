"""Where gradients live between backward and step, and fp32 accumulation of low-precision ones.

Without fp32 accumulation the gradient of p is ``p.grad`` (autograd sums micro-batches into it
in p's dtype). With it, after every backward G_p <- G_p + float32(p.grad) and ``p.grad`` is
freed (a post-accumulate-grad hook), so k micro-batches of bf16 gradients are summed in fp32:
G_p = Σ_k g_p^(k) with one rounding per micro-batch instead of one per addition in bf16.
Nothing communicates until the optimizer step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["GradientStore", "is_low_precision"]

logger = logging.getLogger(__name__)


def is_low_precision(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


class GradientStore:
    """The gradients of ``params``: ``p.grad``, or buffers of ``dtype`` (fp32 by default) when
    ``fp32_accumulation`` for parameters of another dtype (a parameter already in ``dtype``
    accumulates in its own ``p.grad``, bit for bit the same sums, without a second copy)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        fp32_accumulation: bool,
        dtype: torch.dtype = torch.float32,
        buffers: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.fp32_accumulation = fp32_accumulation
        self.dtype = dtype
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = []
        if fp32_accumulation:
            self.add_params(params, buffers)

    def add_params(
        self,
        params: Sequence[torch.Tensor],
        buffers: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Accumulate the gradients of ``params`` (those that require grad and are not of
        ``dtype``) in buffers of ``dtype``: ``buffers[p]`` where given (zeros of p's shape in
        ``dtype``, e.g. views of the flat fp32 master gradients), else a new zero tensor."""
        if not self.fp32_accumulation:
            return
        given = buffers or {}
        for param in params:
            if param in self._buffers or not param.requires_grad:
                continue
            if param.dtype == self.dtype:  # autograd already sums into p.grad in this dtype
                continue
            buffer = given.get(param)
            if buffer is None:
                buffer = torch.zeros_like(param, dtype=self.dtype)
            elif buffer.dtype != self.dtype or buffer.shape != param.shape:
                raise ValueError(
                    f"GradientStore: the buffer given for a param of shape {tuple(param.shape)} "
                    f"is {buffer.dtype} {tuple(buffer.shape)}; expected {self.dtype} of the "
                    f"param's shape"
                )
            self._buffers[param] = buffer
            self._handles.append(param.register_post_accumulate_grad_hook(self._accumulate))
        logger.debug("fp32 gradient accumulation on %d params", len(self._buffers))

    def _accumulate(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._buffers[param].add_(param.grad)
            param.grad = None

    def grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each param's gradient as a tensor that may be modified in place; a param without one
        gets zeros (so every rank reduces the same tensors, used or not)."""
        out = []
        for param in params:
            if self.fp32_accumulation and param in self._buffers:
                out.append(self._buffers[param])
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            out.append(param.grad)
        return out

    @torch.no_grad()
    def scale(self, params: Sequence[torch.Tensor], factor: float, where: str) -> None:
        """G_p <- factor · G_p for every gradient held for ``params``: the accumulation buffer
        and ``p.grad``, wherever one exists (nothing is allocated, nothing communicated).

        ``factor`` must be a finite number (``where`` names the caller in the error); 1.0 is a
        no-op. Low-precision gradients are rounded once to their dtype (exact when ``factor``
        is a power of two)."""
        value = float(factor)
        if not math.isfinite(value):
            raise ValueError(f"{where}: factor must be a finite number, got {factor!r}")
        if value == 1.0:
            return
        grads = [
            grad
            for param in params
            for grad in (self._buffers.get(param), param.grad)
            if grad is not None
        ]
        if grads:
            torch._foreach_mul_(grads, value)

    def zero(self, params: Sequence[torch.Tensor], set_to_none: bool = True) -> None:
        """``p.grad`` <- None (or zeros, ``set_to_none=False``) and every buffer <- 0, the
        zeros in one multi-tensor op."""
        zeros = list(self._buffers.values())
        for param in params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    zeros.append(param.grad.detach_())
        if zeros:
            torch._foreach_zero_(zeros)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
