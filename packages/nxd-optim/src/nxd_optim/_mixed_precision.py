"""Where gradients live between backward and step, and fp32 accumulation of low-precision ones.

Without fp32 accumulation the gradient of p is ``p.grad`` (autograd sums micro-batches into it
in p's dtype). With it, after every backward G_p <- G_p + float32(p.grad) and ``p.grad`` is
freed (a post-accumulate-grad hook), so k micro-batches of bf16 gradients are summed in fp32:
G_p = Σ_k g_p^(k) with one rounding per micro-batch instead of one per addition in bf16.
Nothing communicates until the optimizer step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["GradientStore", "is_low_precision"]

logger = logging.getLogger(__name__)


def is_low_precision(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


class GradientStore:
    """The gradients of ``params``: ``p.grad``, or buffers of ``dtype`` (fp32 by default) when
    ``fp32_accumulation``."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        fp32_accumulation: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.fp32_accumulation = fp32_accumulation
        self.dtype = dtype
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = []
        if fp32_accumulation:
            self.add_params(params)

    def add_params(self, params: Sequence[torch.Tensor]) -> None:
        if not self.fp32_accumulation:
            return
        for param in params:
            if param in self._buffers or not param.requires_grad:
                continue
            self._buffers[param] = torch.zeros_like(param, dtype=self.dtype)
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

    def zero(self, params: Sequence[torch.Tensor], set_to_none: bool = True) -> None:
        for param in params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()
        for buffer in self._buffers.values():
            buffer.zero_()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
