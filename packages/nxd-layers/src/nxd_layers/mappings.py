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

NxD's ``*_with_dim`` variants gather / reduce-scatter along any dimension, and
``scatter_input_channels_to_tensor_model_parallel_region`` splits dim 1 (the channels of an
``[N, C, H, W]`` image, for the input-channel-parallel convolution).

Signatures are NxD's: ``(input_, [sequence_dimension,] ..., process_group=None)``;
``process_group=None`` is the current nxd_state TP group. On a group of one rank every mapping
is the identity (no autograd node). The sequence dimension defaults to 0 (NxD's
sequence-first ``[S, B, H]`` layout). Every collective goes through ``nxd_state.collectives``.

While ``torch.export`` or ``torch.compile`` captures a model, each mapping is instead one
``torch.library`` operator (:mod:`nxd_layers._ops`) whose registered autograd formula is the
Function's backward, so a captured graph keeps the collective and its dual; the kernels are
the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from nxd_layers import _ops
from nxd_layers._attributes import resolve_tensor_parallel_group
from nxd_layers._ops import all_reduce_copy as _all_reduce_copy
from nxd_layers._ops import in_dtype as _in_dtype
from nxd_layers._ops import split_along_dim
from nxd_state import collectives

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region_with_dim",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_scatter_to_tensor_model_parallel_region_with_dim",
    "scatter_input_channels_to_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "split_along_dim",
]


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, dtype: torch.dtype | None
    ) -> torch.Tensor:
        ctx.group, ctx.dtype = group, dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _in_dtype(_all_reduce_copy, grad, ctx.dtype, ctx.group), None, None


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
        ctx: Any,
        x: torch.Tensor,
        dim: int,
        group: ProcessGroup,
        to_model_parallel: bool,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.to_model_parallel = dim, group, to_model_parallel
        ctx.dtype = dtype
        return collectives.all_gather(x, group=group, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        out = _ops.gather_backward(grad, ctx.dim, ctx.group, ctx.to_model_parallel, ctx.dtype)
        return out, None, None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, dtype: torch.dtype | None
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.dtype = dim, group, dtype
        return collectives.reduce_scatter(x.contiguous(), group=group, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.dtype is not None:  # NxD's ``dtype``: the gradient is gathered in this dtype
            grad = grad.to(ctx.dtype)
        return collectives.all_gather(grad, group=ctx.group, dim=ctx.dim), None, None, None


def _group_if_parallel(process_group: ProcessGroup | None) -> ProcessGroup | None:
    """The resolved TP group, or None when it has one rank (every mapping is then identity)."""
    resolved = resolve_tensor_parallel_group(process_group)
    return resolved if collectives.group_size(resolved) > 1 else None


def _check_dim(x: torch.Tensor, dim: object, name: str, what: str = "sequence_dimension") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(
            f"{name}: {what} must be an int, got {dim!r} (NxD's argument order: input_, "
            f"{what}, ..., process_group)"
        )
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{name}: {what}={dim} is out of range for a {x.dim()}-D input of shape "
            f"{tuple(x.shape)}"
        )
    return dim


def copy_to_tensor_model_parallel_region(
    input_: torch.Tensor,
    process_group: ProcessGroup | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Y = X; dL/dX = sum over TP of dL/dY (the input of a column-parallel region), the sum
    taken in ``dtype`` when given (nxd's keyword; NxD's layers call it ``reduce_dtype``)."""
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.copy_to_tp(input_, _ops.group_key(resolved), dtype)
    return _CopyToTensorParallel.apply(input_, resolved, dtype)


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y = sum over TP of X_r; dL/dX_r = dL/dY (the output of a row-parallel region)."""
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.reduce_from_tp(input_, _ops.group_key(resolved))
    return _ReduceFromTensorParallel.apply(input_, resolved)


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y_r = X[..., r-th chunk of the last dim]; backward all-gathers the last dim."""
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.split(input_, -1, _ops.group_key(resolved))
    return _ScatterToTensorParallel.apply(input_, resolved)


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y = [X_0, ..., X_{n-1}] along the last dim; backward keeps this rank's chunk."""
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.gather(input_, -1, _ops.group_key(resolved), False, None)
    return _GatherFromTensorParallel.apply(input_, resolved)


def scatter_input_channels_to_tensor_model_parallel_region(
    input_: torch.Tensor, process_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y_r = r-th chunk of X along dim 1 (the channels of [N, C, H, W]); backward all-gathers."""
    _check_dim(input_, 1, "scatter_input_channels_to_tensor_model_parallel_region", "dim")
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.split(input_, 1, _ops.group_key(resolved))
    return _ScatterToSequenceParallel.apply(input_, 1, resolved)


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor, sequence_dimension: int = 0, process_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y_r = r-th chunk of X along the sequence dim; backward all-gathers it."""
    dim = _check_dim(input_, sequence_dimension, "scatter_to_sequence_parallel_region")
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.split(input_, dim, _ops.group_key(resolved))
    return _ScatterToSequenceParallel.apply(input_, dim, resolved)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    sequence_dimension: int = 0,
    to_model_parallel: bool = True,
    process_group: ProcessGroup | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Y = [X_0; ...; X_{n-1}] along the sequence dim.

    Backward: reduce-scatter (the consumer is a TP region whose ranks each produce a partial
    gradient; in ``dtype`` when given, nxd's keyword), or with ``to_model_parallel=False`` a
    split (every rank's gradient is whole).
    """
    dim = _check_dim(input_, sequence_dimension, "gather_from_sequence_parallel_region")
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.gather(input_, dim, _ops.group_key(resolved), to_model_parallel, dtype)
    return _GatherFromSequenceParallel.apply(input_, dim, resolved, to_model_parallel, dtype)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    sequence_dimension: int = 0,
    process_group: ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Y_r = r-th chunk along the sequence dim of sum over TP of X; backward all-gathers
    (the gradient cast to ``dtype`` first when given)."""
    dim = _check_dim(input_, sequence_dimension, "reduce_scatter_to_sequence_parallel_region")
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.reduce_scatter(input_, dim, _ops.group_key(resolved), dtype)
    return _ReduceScatterToSequenceParallel.apply(input_, dim, resolved, dtype)


def gather_from_tensor_model_parallel_region_with_dim(
    input_: torch.Tensor, gather_dim: int, process_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y = [X_0, ..., X_{n-1}] along ``gather_dim``; backward keeps this rank's chunk."""
    name = "gather_from_tensor_model_parallel_region_with_dim"
    dim = _check_dim(input_, gather_dim, name, "gather_dim")
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.gather(input_, dim, _ops.group_key(resolved), False, None)
    return _GatherFromSequenceParallel.apply(input_, dim, resolved, False)


def reduce_scatter_to_tensor_model_parallel_region_with_dim(
    input_: torch.Tensor, partition_dim: int, process_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Y_r = r-th chunk along ``partition_dim`` of sum over TP of X; backward all-gathers."""
    name = "reduce_scatter_to_tensor_model_parallel_region_with_dim"
    dim = _check_dim(input_, partition_dim, name, "partition_dim")
    resolved = _group_if_parallel(process_group)
    if resolved is None:
        return input_
    if _ops.use_operators():
        return _ops.reduce_scatter(input_, dim, _ops.group_key(resolved), None)
    return _ReduceScatterToSequenceParallel.apply(input_, dim, resolved, None)
