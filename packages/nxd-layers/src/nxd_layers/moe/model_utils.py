"""NxD's MoE helpers: activation names and the sequence-parallel modes."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ACT2FN", "MoESequenceParallelMode"]

ACT2FN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "leaky_relu": F.leaky_relu,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "tanh": torch.tanh,
}


class MoESequenceParallelMode(enum.StrEnum):
    """How a MoE layer meets sequence parallelism (NxD's names). nxd runs ``NO_SP`` only: the
    others are refused by the expert MLPs, naming the mode."""

    NO_SP = "NO_SP"
    EXIT_SP_ON_ENTRY = "EXIT_SP_ON_ENTRY"
    EXIT_SP_ON_ENTRY_DELAY_MLP_AR = "EXIT_SP_ON_ENTRY_DELAY_MLP_AR"
    OPTIMIZED_SP_MATMUL = "OPTIMIZED_SP_MATMUL"
