"""Deterministic initialisation: build the full master weight from the seed, keep a slice.

Every TP rank draws the same full tensor from the shared (TP-equal) CPU generator and keeps
its slice, so a model built at any TP degree holds exactly the weights of the TP=1 model built
with the same seed. Initialisation runs on CPU in float32 whatever the target device and
dtype, so CPU, CUDA and XLA runs start from the same numbers. On the ``meta`` device nothing is
drawn (no memory, no RNG consumed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nxd_layers._attributes import shard_for_rank
from nxd_layers.meta_init import parameters_on_meta

__all__ = ["InitMethod", "default_linear_init", "init_master", "is_meta", "sharded_parameter"]

InitMethod = Callable[[torch.Tensor], Any]


def default_linear_init(weight: torch.Tensor) -> None:
    """W ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)): ``torch.nn.Linear``'s default (kaiming, a=sqrt 5)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def is_meta(device: torch.device | str | None) -> bool:
    """Whether the layer's parameters end on ``meta``: built with ``device="meta"``, or inside
    ``init_on_device(torch.device("meta"))`` (then no master weight is drawn either)."""
    return parameters_on_meta() or (device is not None and torch.device(device).type == "meta")


def init_master(shape: tuple[int, ...], init_method: InitMethod | None) -> torch.Tensor:
    """The full tensor, float32 on CPU: ``init_method`` applied to it, or zeros if None."""
    master = torch.zeros(shape, dtype=torch.float32)
    if init_method is not None:
        with torch.no_grad():
            init_method(master)
    return master


def sharded_parameter(
    master: torch.Tensor | None,
    local_shape: tuple[int, ...],
    *,
    partition_dim: int | None,
    rank: int,
    world_size: int,
    stride: int = 1,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> nn.Parameter:
    """A parameter holding this rank's slice of ``master`` (the whole of it if not sharded).

    ``master`` is None on the meta device: the parameter is then allocated, uninitialised.
    """
    if master is None:
        return nn.Parameter(torch.empty(local_shape, dtype=dtype, device=device))
    local = master
    if partition_dim is not None:
        local = shard_for_rank(master, partition_dim, rank, world_size, stride)
    if tuple(local.shape) != tuple(local_shape):  # pragma: no cover - internal arithmetic
        raise RuntimeError(f"slice shape {tuple(local.shape)} != expected {local_shape}")
    return nn.Parameter(local.to(dtype=dtype, device=device).contiguous())
