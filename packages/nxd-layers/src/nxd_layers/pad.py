"""Pad attention heads up to a multiple of the TP degree (NxD's ``pad_model``).

With n heads and TP degree t, n' = ceil(n / t) * t heads divide evenly. Padding appends
n' - n zero heads: the column-parallel Q/K/V projections get zero output rows and the
row-parallel output projection zero input columns, both at the end of the *full* (unsharded)
weight, which is then re-sharded. A zero head's attention output is a mean of zero values,
and its output-projection columns are zero, so the model computes what it did before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nxd_layers._attributes import (
    full_tensor,
    set_tensor_model_parallel_attributes,
    shard_for_rank,
    tensor_parallel_rank_and_size,
)
from nxd_layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["get_number_of_extra_heads", "pad_model"]

logger = logging.getLogger(__name__)


def get_number_of_extra_heads(n_head: int, tp_degree: int) -> int:
    """n' - n, with n' = the smallest multiple of ``tp_degree`` >= ``n_head``."""
    if n_head <= 0 or tp_degree <= 0:
        raise ValueError(f"n_head({n_head}) and tp_degree({tp_degree}) must be positive")
    return -n_head % tp_degree


def _repad(param: nn.Parameter, dim: int, new_full: int, rank: int, tp: int) -> nn.Parameter:
    """Gather ``param`` over TP, zero-pad ``dim`` of the full tensor to ``new_full``, re-shard."""
    full = full_tensor(param)
    pad = [0, 0] * (full.dim() - 1 - dim) + [0, new_full - full.shape[dim]]
    padded = F.pad(full, pad)
    new = nn.Parameter(shard_for_rank(padded, dim, rank, tp).contiguous())
    for key, value in vars(param).items():
        setattr(new, key, value)
    return new


def _pad_layer(module: nn.Module, n_heads: int, n_padded: int) -> None:
    rank, tp = tensor_parallel_rank_and_size(module.tensor_parallel_group)
    if module.stride != 1:
        raise ValueError(
            f"pad_model cannot pad {type(module).__name__} with stride {module.stride}"
        )
    size = module.output_size if isinstance(module, ColumnParallelLinear) else module.input_size
    if size % n_heads != 0:
        raise ValueError(
            f"pad_model: {type(module).__name__} size {size} is not a multiple of "
            f"n_heads({n_heads}); wrap only the attention classes (wrapped_classes=...)"
        )
    new_size = size // n_heads * n_padded
    with torch.no_grad():
        if isinstance(module, ColumnParallelLinear):
            module.weight = _repad(module.weight, 0, new_size, rank, tp)
            if module.bias is not None:
                module.bias = _repad(module.bias, 0, new_size, rank, tp)
            module.output_size, module.output_size_per_partition = new_size, new_size // tp
        else:
            module.weight = _repad(module.weight, 1, new_size, rank, tp)
            module.input_size, module.input_size_per_partition = new_size, new_size // tp
    set_tensor_model_parallel_attributes(module.weight, True, module.weight.partition_dim, 1)
    module.master_weight = None
    logger.info("padded %s from %d to %d features", type(module).__name__, size, new_size)


def pad_model(
    model: nn.Module,
    tp_degree: int,
    n_heads: int,
    wrapped_classes: Iterable[type] = (),
    pad_hook_fn: Callable[[nn.Module, float], Any] | None = None,
) -> nn.Module:
    """Pad every Column/RowParallelLinear (inside ``wrapped_classes`` if given) from
    ``n_heads`` to ``n_heads + get_number_of_extra_heads(n_heads, tp_degree)`` heads.

    ``pad_hook_fn(module, n_padded / n_heads)`` is called on each instance of
    ``wrapped_classes`` (on ``model`` when none are given): the place to update head counts
    or a ``split_size``. Collective: every TP rank must call it. Returns
    ``model``, modified in place; build the optimizer afterwards (parameters are replaced).
    """
    _, tp = tensor_parallel_rank_and_size(None)
    if tp_degree != tp:
        raise ValueError(
            f"pad_model: tp_degree({tp_degree}) differs from the current tensor_parallel_size({tp})"
        )
    n_padded = n_heads + get_number_of_extra_heads(n_heads, tp_degree)
    if n_padded == n_heads:
        return model
    ratio = n_padded / n_heads
    classes = tuple(wrapped_classes)

    def visit(module: nn.Module, inside: bool) -> None:
        for child in module.children():
            visit(child, inside or isinstance(child, classes))
        if not inside:
            return
        if pad_hook_fn is not None and (isinstance(module, classes) or module is model):
            pad_hook_fn(module, ratio)
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            _pad_layer(module, n_heads, n_padded)

    visit(model, not classes or isinstance(model, classes))
    return model
