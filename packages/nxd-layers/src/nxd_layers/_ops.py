"""The TP collectives and the vocabulary-parallel cross entropy as ``torch.library`` operators.

Eagerly, :mod:`nxd_layers.mappings` and :mod:`nxd_layers.loss_functions` apply their
``autograd.Function``s. A graph captured by ``torch.export`` or ``torch.compile`` cannot hold
such a Function: it records the operations of its forward, and the graph's backward becomes
their derivative (``y = x`` gives ``dL/dx = dL/dy`` where the mapping's backward is the
all-reduce ``dL/dx = sum over TP of dL/dy``). While compiling or exporting, the same mappings
are therefore these operators, each one graph node whose registered autograd formula is the
Function's backward, computed by the same kernels:

==========================  ===================================  ===========================
operator                    forward                              backward
==========================  ===================================  ===========================
``copy_to_tp``              Y = X (a copy: an operator's output  sum over TP (in ``dtype``)
                            may not alias its input)
``reduce_from_tp``          Y = sum over TP of X                 identity
``split``                   Y_r = r-th chunk along ``dim``       all-gather along ``dim``
``gather``                  Y = [X_0, ..., X_{n-1}] along dim    reduce-scatter (in ``dtype``)
                                                                 or split
``reduce_scatter``          Y_r = r-th chunk of sum over TP      all-gather (grad in ``dtype``)
``parallel_cross_entropy``  log Z_t - z_t,y_t (smoothed)         softmax(z) - onehot(y) ...
==========================  ===================================  ===========================

The process group is an operator argument by its torch name (``ProcessGroup.group_name``,
what torch's functional collectives use), resolved when the operator runs. The fake
(meta) implementations give each output's shape from the group's size (every output is
contiguous, in the kernels too, so a compiled graph's views match), so a capture with
dynamic batch and sequence sizes keeps them symbolic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed import ProcessGroup, ReduceOp
from torch.distributed.distributed_c10d import _resolve_process_group

from nxd_state import collectives

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["ce_backward", "ce_forward", "group_key", "split_along_dim", "use_operators"]

_LIB = "nxd_layers"


def use_operators() -> bool:
    """Whether a mapping is being captured into a graph that will be differentiated
    (``torch.compile`` or ``torch.export``, which sets the same flag, with gradients on), so it
    must be one operator node carrying its backward. A capture without gradients (inference
    tracing) records the forward's functional collectives instead: the portable form AOTInductor
    and the Neuron compiler consume, and loadable without nxd_layers."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled()


def group_key(group: ProcessGroup) -> str:
    """The name an operator carries for ``group`` (torch's own registry name)."""
    return group.group_name


def _group(key: str) -> ProcessGroup:
    try:
        return _resolve_process_group(cast("GroupName", key))  # a name from group_key
    except (KeyError, ValueError, RuntimeError) as error:
        raise RuntimeError(
            f"an nxd_layers operator refers to process group {key!r}, which no longer exists "
            f"(destroyed after the graph was captured?); capture the model again"
        ) from error


def _fresh(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` as an operator returns it: contiguous, the strides every fake implementation
    below gives (a compiled graph views outputs by those strides; a gather or reduce-scatter
    along dim > 0 ends in ``movedim``), and copied when it shares ``x``'s storage (an
    operator's output may not alias its input)."""
    y = y.contiguous()
    same = y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return y.clone() if same else y


# Kernels, shared by the eager autograd Functions and the operators --------------------------
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


def all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over ``group`` into a new tensor (``x`` is left alone); ``x`` itself on one rank."""
    if collectives.group_size(group) == 1:
        return x.view_as(x)
    return collectives.all_reduce(x.contiguous().clone(), group=group)


def in_dtype(
    fn: Any, grad: torch.Tensor, dtype: torch.dtype | None, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``fn(grad, ...)`` computed on ``grad`` cast to ``dtype`` (None: as is), cast back."""
    if dtype is None or dtype == grad.dtype:
        return fn(grad, *args, **kwargs)
    return fn(grad.to(dtype), *args, **kwargs).to(grad.dtype)


def gather_backward(
    grad: torch.Tensor, dim: int, group: ProcessGroup, to_model_parallel: bool, dtype: Any
) -> torch.Tensor:
    """dL/dX_r of an all-gather: the sum over TP of dL/dY's chunk r (each rank's gradient is
    partial), or, with ``to_model_parallel=False``, chunk r (every rank's is whole)."""
    if to_model_parallel:
        return in_dtype(collectives.reduce_scatter, grad.contiguous(), dtype, group, dim=dim)
    return split_along_dim(grad, dim, group)


# The cross entropy's kernels (the math: nxd_layers.loss_functions) -------------------------
def smoothing_coefficient(label_smoothing: float, vocab: int) -> float:
    """s = eps V / (V - 1): NxD's eps (spread over the V - 1 wrong classes) as the coefficient
    of the uniform target over all V classes (``F.cross_entropy``'s ``label_smoothing``)."""
    if label_smoothing == 0:
        return 0.0
    if vocab < 2:
        raise ValueError(f"label_smoothing needs a vocabulary of at least 2 classes, got {vocab}")
    return label_smoothing * vocab / (vocab - 1)


def ce_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    group: ProcessGroup,
) -> tuple[torch.Tensor, ...]:
    """(loss, softmax of the local columns, local label ids, label not here, ignored)."""
    rank, tp = collectives.group_rank(group), collectives.group_size(group)
    local_vocab = logits.shape[-1]
    vocab = local_vocab * tp
    z = logits.float()
    z_max = z.max(dim=-1).values
    collectives.all_reduce(z_max, group=group, op=ReduceOp.MAX)
    z = z - z_max.unsqueeze(-1)  # (..., V/p), <= 0: exp cannot overflow
    exp = z.exp()
    sum_exp = exp.sum(dim=-1)
    collectives.all_reduce(sum_exp, group=group)

    start = rank * local_vocab
    ignored = labels == ignore_index
    outside = (labels < start) | (labels >= start + local_vocab) | ignored
    local_labels = (labels - start).masked_fill(outside, 0)
    target = z.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    collectives.all_reduce(target, group=group)

    log_z = sum_exp.log()
    loss = log_z - target
    smoothing = smoothing_coefficient(label_smoothing, vocab)
    if smoothing > 0:
        z_sum = z.sum(dim=-1)
        collectives.all_reduce(z_sum, group=group)
        loss = (1.0 - smoothing) * loss + smoothing * (log_z - z_sum / vocab)
    loss = loss.masked_fill(ignored, 0.0)
    exp.div_(sum_exp.unsqueeze(-1))  # softmax, local columns
    return loss, exp, local_labels, outside, ignored


def ce_backward(
    softmax: torch.Tensor,
    local_labels: torch.Tensor,
    outside: torch.Tensor,
    ignored: torch.Tensor,
    grad_loss: torch.Tensor,
    smoothing: float,
    vocab: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """dL/dz = (softmax(z) - (1 - s) onehot(y) - s / V) dL/dloss, local columns (in place on
    ``softmax``)."""
    grad = softmax
    onehot_scale = (~outside).to(grad.dtype) * (1.0 - smoothing)
    grad.scatter_add_(-1, local_labels.unsqueeze(-1), -onehot_scale.unsqueeze(-1))
    if smoothing > 0:
        grad.sub_(smoothing / vocab)
    grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
    return grad.to(dtype)


# Operators ---------------------------------------------------------------------------------
def _resized(x: torch.Tensor, dim: int, size: Any) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


def _divided(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    n = collectives.group_size(_group(key))
    torch._check(
        x.shape[dim] % n == 0,
        lambda: f"cannot split dim {dim} of size {x.shape[dim]} into {n} tensor parallel shards",
    )
    return _resized(x, dim, x.shape[dim] // n)


@torch.library.custom_op(f"{_LIB}::copy_to_tp", mutates_args=())
def copy_to_tp(x: torch.Tensor, group: str, dtype: torch.dtype | None) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


@copy_to_tp.register_fake
def _(x: torch.Tensor, group: str, dtype: torch.dtype | None) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_LIB}::reduce_from_tp", mutates_args=())
def reduce_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    return _fresh(all_reduce_copy(x, _group(group)), x)


@reduce_from_tp.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_LIB}::split", mutates_args=())
def split(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _fresh(split_along_dim(x, dim, _group(group)), x)


@split.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _divided(x, dim, group)


@torch.library.custom_op(f"{_LIB}::gather", mutates_args=())
def gather(
    x: torch.Tensor, dim: int, group: str, to_model_parallel: bool, dtype: torch.dtype | None
) -> torch.Tensor:
    return _fresh(collectives.all_gather(x, group=_group(group), dim=dim), x)


@gather.register_fake
def _(
    x: torch.Tensor, dim: int, group: str, to_model_parallel: bool, dtype: torch.dtype | None
) -> torch.Tensor:
    return _resized(x, dim, x.shape[dim] * collectives.group_size(_group(group)))


@torch.library.custom_op(f"{_LIB}::reduce_scatter", mutates_args=())
def reduce_scatter(
    x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None
) -> torch.Tensor:
    return _fresh(collectives.reduce_scatter(x.contiguous(), group=_group(group), dim=dim), x)


@reduce_scatter.register_fake
def _(x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None) -> torch.Tensor:
    return _divided(x, dim, group)


@torch.library.custom_op(f"{_LIB}::parallel_cross_entropy", mutates_args=())
def parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    group: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = ce_forward(logits, labels, label_smoothing, ignore_index, _group(group))
    loss, softmax, local_labels, outside, ignored = out
    return loss, softmax, _fresh(local_labels, labels), outside, ignored


@parallel_cross_entropy.register_fake
def _(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    group: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = labels.new_empty(labels.shape, dtype=torch.float32)
    softmax = logits.new_empty(logits.shape, dtype=torch.float32)
    flags = labels.new_empty(labels.shape, dtype=torch.bool)
    return loss, softmax, torch.empty_like(labels), flags, torch.empty_like(flags)


# Autograd formulas: each the eager Function's backward, written with the operators ---------
def _setup_group(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.inputs = inputs[1:]


def _copy_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    group, dtype = ctx.inputs
    return in_dtype(reduce_from_tp, grad, dtype, group), None, None


def _reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    return grad, None


def _split_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    dim, group = ctx.inputs
    return gather(grad, dim, group, False, None), None, None


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    dim, group, to_model_parallel, dtype = ctx.inputs
    if to_model_parallel:
        out = in_dtype(reduce_scatter, grad, dtype, dim, group, None)
    else:
        out = split(grad, dim, group)
    return out, None, None, None, None


def _reduce_scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    dim, group, dtype = ctx.inputs
    if dtype is not None:  # NxD's ``dtype``: the gradient is gathered in this dtype
        grad = grad.to(dtype)
    return gather(grad, dim, group, False, None), None, None, None


copy_to_tp.register_autograd(_copy_backward, setup_context=_setup_group)
reduce_from_tp.register_autograd(_reduce_backward, setup_context=_setup_group)
split.register_autograd(_split_backward, setup_context=_setup_group)
gather.register_autograd(_gather_backward, setup_context=_setup_group)
reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_setup_group)


def _ce_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    logits, _, label_smoothing, _, group = inputs
    _, softmax, local_labels, outside, ignored = output
    ctx.save_for_backward(softmax, local_labels, outside, ignored)
    vocab = logits.shape[-1] * collectives.group_size(_group(group))
    ctx.smoothing = smoothing_coefficient(label_smoothing, vocab)
    ctx.vocab, ctx.dtype = vocab, logits.dtype
    ctx.set_materialize_grads(False)  # only the loss is differentiated


def _ce_backward(ctx: Any, grad_loss: torch.Tensor | None, *unused: Any) -> tuple[Any, ...]:
    if grad_loss is None:
        return None, None, None, None, None
    softmax, local_labels, outside, ignored = ctx.saved_tensors
    grad = ce_backward(
        softmax, local_labels, outside, ignored, grad_loss, ctx.smoothing, ctx.vocab, ctx.dtype
    )
    return grad, None, None, None, None


parallel_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)
