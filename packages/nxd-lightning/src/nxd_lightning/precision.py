"""``NeuronXLAPrecisionPlugin``: fp32, or bf16 parameters with fp32 master weights.

NxD's plugin only steps the optimizer (Lightning's XLA plugin would all-reduce gradients over
the whole world in ``xm.optimizer_step``; NxD's optimizer wrapper reduces over data
parallelism itself). This one does the same on every device and, with
``mixed_precision_enabled=True``, trains in bf16 the way NxD does on Trainium:

    θ_bf16 = cast(θ_32)           the model's parameters and activations are bf16
    θ_32 <- step(θ_32, g)         the optimizer wrapper keeps fp32 masters and steps those

The module's floating-point parameters are cast to bf16 after ``setup`` built them (before the
optimizer exists), floating-point inputs are cast too, and the optimizer must keep masters:
``mixed_precision_config={"use_master_weights": True, ...}`` in the ``nxd_config`` (the default
with ZeRO-1), checked when the optimizer is connected.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch import nn

__all__ = ["NeuronXLAPrecisionPlugin"]


class NeuronXLAPrecisionPlugin(Precision):
    """fp32 (default), or bf16 with fp32 master weights (``mixed_precision_enabled=True``)."""

    def __init__(self, mixed_precision_enabled: bool = False) -> None:
        self.mixed_precision_enabled = bool(mixed_precision_enabled)
        self.precision = "bf16-true" if self.mixed_precision_enabled else "32-true"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mixed_precision_enabled else torch.float32

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.mixed_precision_enabled:
            module.to(dtype=torch.bfloat16)  # in place: parameter objects and attributes kept
        return module

    def convert_input(self, data: Any) -> Any:
        if not self.mixed_precision_enabled:
            return data
        return apply_to_collection(
            data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=torch.bfloat16
        )

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Tensors created during the forward default to the training dtype."""
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        if self.mixed_precision_enabled:
            from nxd_optim import NxDOptimizer

            for optimizer in optimizers:
                keeps_masters = isinstance(optimizer, NxDOptimizer) and (
                    optimizer.mixed_precision.master_weights
                )
                if not keeps_masters:
                    raise ValueError(
                        f"NeuronXLAPrecisionPlugin(mixed_precision_enabled=True) trains bf16 "
                        f"parameters on fp32 master weights, but the optimizer "
                        f"{type(optimizer).__qualname__} keeps none: build it with "
                        f"initialize_parallel_optimizer and mixed_precision_config="
                        f"{{'use_master_weights': True, 'use_fp32_grad_acc': True}} in nxd_config"
                    )
        return super().connect(model, optimizers, lr_schedulers)
