"""Autograd collectives between the replicated, TP-sharded and sequence-sharded regions.

One ``autograd.Function`` per collective, its backward the dual:

=========================================  ======================  =========================
function                                   forward                 backward
=========================================  ======================  =========================
copy_to_tensor_model_parallel_region       identity                all-reduce
reduce_from_tensor_model_parallel_region   all-reduce              identity
scatter_to_tensor_model_parallel_region    split last dim          all-gather last dim
gather_from_tensor_model_parallel_region   all-gather last dim     split last dim
scatter_to_sequence_parallel_region        split sequence dim      all-gather sequence dim
gather_from_sequence_parallel_region       all-gather sequence     reduce-scatter sequence
                                                                   (split if not
                                                                   ``to_model_parallel``)
reduce_scatter_to_sequence_parallel_region reduce-scatter seq.     all-gather sequence dim
=========================================  ======================  =========================

``group=None`` is the current nxd_state TP group; on a group of one rank every mapping is the
identity (no autograd node). The sequence dimension defaults to 0 (NxD's
sequence-first ``[S, B, H]`` layout). Every collective goes through ``nxd_state.collectives``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from nxd_layers._attributes import resolve_tensor_parallel_group
from nxd_state import collectives

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "split_along_dim",
]


def split_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """X_r: chunk ``rank`` of ``x`` split into ``group size`` equal chunks along ``dim``."""
    n = collectives.group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) into "
            f"{n} tensor parallel shards: {x.shape[dim]} is not divisible by {n}"
        )
    return x.chunk(n, dim=dim)[collectives.group_rank(group)].contiguous()


def _all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over ``group`` into a new tensor (``x`` is left alone); ``x`` itself on one rank."""
    if collectives.group_size(group) == 1:
        return x.view_as(x)
    return collectives.all_reduce(x.contiguous().clone(), group=group)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce_copy(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return collectives.all_gather(grad, group=ctx.group, dim=-1), None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return collectives.all_gather(x, group=group, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return split_along_dim(grad, -1, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return split_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.all_gather(grad, group=ctx.group, dim=ctx.dim), None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, to_model_parallel: bool
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.to_model_parallel = dim, group, to_model_parallel
        return collectives.all_gather(x, group=group, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.to_model_parallel:  # every rank holds a partial gradient: sum, keep my shard
            out = collectives.reduce_scatter(grad.contiguous(), group=ctx.group, dim=ctx.dim)
        else:  # every rank holds the same full gradient: keep my shard
            out = split_along_dim(grad, ctx.dim, ctx.group)
        return out, None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return collectives.reduce_scatter(x.contiguous(), group=group, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.all_gather(grad, group=ctx.group, dim=ctx.dim), None, None


def _group_if_parallel(group: ProcessGroup | None) -> ProcessGroup | None:
    """The resolved TP group, or None when it has one rank (every mapping is then identity)."""
    resolved = resolve_tensor_parallel_group(group)
    return resolved if collectives.group_size(resolved) > 1 else None


def _check_sequence_dim(x: torch.Tensor, sequence_dimension: int, name: str) -> None:
    if not -x.dim() <= sequence_dimension < x.dim():
        raise ValueError(
            f"{name}: sequence_dimension={sequence_dimension} is out of range for a "
            f"{x.dim()}-D input of shape {tuple(x.shape)}"
        )


def copy_to_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y = X; dL/dX = sum over TP of dL/dY (the input of a column-parallel region)."""
    resolved = _group_if_parallel(group)
    return x if resolved is None else _CopyToTensorParallel.apply(x, resolved)


def reduce_from_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y = sum over TP of X_r; dL/dX_r = dL/dY (the output of a row-parallel region)."""
    resolved = _group_if_parallel(group)
    return x if resolved is None else _ReduceFromTensorParallel.apply(x, resolved)


def scatter_to_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y_r = X[..., r-th chunk of the last dim]; backward all-gathers the last dim."""
    resolved = _group_if_parallel(group)
    return x if resolved is None else _ScatterToTensorParallel.apply(x, resolved)


def gather_from_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y = [X_0, ..., X_{n-1}] along the last dim; backward keeps this rank's chunk."""
    resolved = _group_if_parallel(group)
    return x if resolved is None else _GatherFromTensorParallel.apply(x, resolved)


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None, sequence_dimension: int = 0
) -> torch.Tensor:
    """Y_r = r-th chunk of X along the sequence dim; backward all-gathers it."""
    _check_sequence_dim(x, sequence_dimension, "scatter_to_sequence_parallel_region")
    resolved = _group_if_parallel(group)
    return (
        x if resolved is None else _ScatterToSequenceParallel.apply(x, sequence_dimension, resolved)
    )


def gather_from_sequence_parallel_region(
    x: torch.Tensor,
    group: ProcessGroup | None = None,
    sequence_dimension: int = 0,
    to_model_parallel: bool = True,
) -> torch.Tensor:
    """Y = [X_0; ...; X_{n-1}] along the sequence dim.

    Backward: reduce-scatter (the consumer is a TP region whose ranks each produce a partial
    gradient), or with ``to_model_parallel=False`` a split (every rank's gradient is whole).
    """
    _check_sequence_dim(x, sequence_dimension, "gather_from_sequence_parallel_region")
    resolved = _group_if_parallel(group)
    if resolved is None:
        return x
    return _GatherFromSequenceParallel.apply(x, sequence_dimension, resolved, to_model_parallel)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None, sequence_dimension: int = 0
) -> torch.Tensor:
    """Y_r = r-th chunk along the sequence dim of sum over TP of X; backward all-gathers."""
    _check_sequence_dim(x, sequence_dimension, "reduce_scatter_to_sequence_parallel_region")
    resolved = _group_if_parallel(group)
    if resolved is None:
        return x
    return _ReduceScatterToSequenceParallel.apply(x, sequence_dimension, resolved)
