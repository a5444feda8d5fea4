"""Pad attention heads up to a multiple of the TP degree (NxD's ``pad_model``).

With n heads and TP degree t, n' = ceil(n / t) * t heads divide evenly; every
Column/RowParallelLinear of the padded region grows its sharded dim by n' / n.

NxD's layout (the default): each rank zero-pads *its own shard* at the end, so rank r holds
its original rows (Column) or columns (Row) followed by zeros, and the zeros are spread over
the ranks: the per-rank state dicts are NxD's, so padded checkpoints interchange. A Column ->
elementwise -> Row block computes what it did before (zero features meet zero weights). Under
attention the original shard of a rank is not a whole number of heads when t does not divide
n, so a padded local head mixes part of an original head with zeros and the attention output
changes (in NxD as here).

``head_aligned=True`` (nxd's extension): pad the *full* weight with n' - n zero heads at the
end and re-shard, so every rank holds whole heads and attention outputs are unchanged; the
per-rank layout then differs from NxD's.

Every padded parameter is marked with ``tensor_parallel_padding``, a
:class:`TensorParallelPadding` saying which dim grew from which global size, in which layout
and at which TP degree, so checkpoints can store (and other TP degrees load) the unpadded
tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
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

__all__ = [
    "HEAD_ALIGNED",
    "PER_RANK",
    "TensorParallelPadding",
    "get_number_of_extra_heads",
    "pad_model",
]

logger = logging.getLogger(__name__)

PER_RANK = "per_rank"
"""NxD's layout: each of the ``tp_size`` equal chunks of the padded tensor is one rank's
original shard followed by its zeros."""
HEAD_ALIGNED = "head_aligned"
"""``pad_model(head_aligned=True)``: the original tensor followed by zeros (whole heads)."""


@dataclass(frozen=True)
class TensorParallelPadding:
    """What :func:`pad_model` appended to a parameter: P (``padded_size`` along ``dim``) holds
    U (``unpadded_size``) plus zeros, both global (unsharded) sizes.

    With t = ``tp_size`` (the TP degree it was padded at), u = U/t and p = P/t:

    * ``per_rank`` (NxD's): ``P[r·p + i] = U[r·u + i]`` for i < u, zero for u <= i < p: rank
      r's shard of P is its shard of U followed by p - u zeros;
    * ``head_aligned``: ``P[i] = U[i]`` for i < U, zero after.

    Set on the padded weights and biases of Column/RowParallelLinear as the attribute
    ``tensor_parallel_padding`` (also on a gathered Column's replicated full bias, whose
    chunks follow the same layout). ``dim`` is the tensor's padded dimension (0 for a Column's
    weight and biases, 1 for a Row's weight).
    """

    dim: int
    """The padded dimension."""
    unpadded_size: int
    """Global size of ``dim`` before padding."""
    padded_size: int
    """Global size of ``dim`` after padding."""
    layout: str
    """``"per_rank"`` (:data:`PER_RANK`) or ``"head_aligned"`` (:data:`HEAD_ALIGNED`)."""
    tp_size: int
    """The TP degree the tensor was padded at (the per-rank chunks)."""

    def __post_init__(self) -> None:
        if self.layout not in (PER_RANK, HEAD_ALIGNED):
            raise ValueError(
                f"padding layout must be {PER_RANK!r} or {HEAD_ALIGNED!r}, got {self.layout!r}"
            )
        if self.dim < 0 or self.tp_size < 1 or not 0 < self.unpadded_size <= self.padded_size:
            raise ValueError(
                f"padding of dim {self.dim} from {self.unpadded_size} to {self.padded_size} "
                f"at tp_size {self.tp_size}: need dim >= 0, tp_size >= 1 and "
                f"0 < unpadded_size <= padded_size"
            )
        if self.padded_size % self.tp_size or (
            self.layout == PER_RANK and self.unpadded_size % self.tp_size
        ):
            raise ValueError(
                f"{self.layout} padding from {self.unpadded_size} to {self.padded_size}: the "
                f"sizes must be multiples of tp_size({self.tp_size})"
            )

    def runs(self) -> list[tuple[int, int, int]]:
        """Where U lies in P along ``dim``: ``(padded_start, unpadded_start, length)``, in
        order; everything else in P is zeros."""
        if self.layout == HEAD_ALIGNED:
            return [(0, 0, self.unpadded_size)]
        u, p = self.unpadded_size // self.tp_size, self.padded_size // self.tp_size
        return [(r * p, r * u, u) for r in range(self.tp_size)]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """U from the full padded tensor P (``padded.shape[dim] == padded_size``)."""
        if padded.shape[self.dim] != self.padded_size:
            raise ValueError(
                f"tensor of shape {tuple(padded.shape)} is not padded to {self.padded_size} "
                f"along dim {self.dim}"
            )
        parts = [padded.narrow(self.dim, start, n) for start, _, n in self.runs()]
        return torch.cat(parts, dim=self.dim)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (checkpoint indexes record them)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorParallelPadding:
        """The inverse of :meth:`to_dict`."""
        fields = ("dim", "unpadded_size", "padded_size", "layout", "tp_size")
        return cls(**{name: data[name] for name in fields})


def get_number_of_extra_heads(n_head: int, tp_degree: int) -> int:
    """n' - n, with n' = the smallest multiple of ``tp_degree`` >= ``n_head``."""
    if n_head <= 0 or tp_degree <= 0:
        raise ValueError(f"n_head({n_head}) and tp_degree({tp_degree}) must be positive")
    return -n_head % tp_degree


def _with_attributes(value: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    new = nn.Parameter(value.contiguous(), requires_grad=like.requires_grad)
    for key, attribute in vars(like).items():
        setattr(new, key, attribute)
    return new


def _pad_end(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``dim`` up to ``size``."""
    widths = [0, 0] * tensor.dim()
    widths[2 * (tensor.dim() - 1 - dim) + 1] = size - tensor.shape[dim]
    return F.pad(tensor, widths)


def _mark(param: nn.Parameter, padding: TensorParallelPadding) -> nn.Parameter:
    param.tensor_parallel_padding = padding  # type: ignore[attr-defined]
    return param


def _pad_local(param: nn.Parameter, dim: int, local_size: int) -> nn.Parameter:
    """NxD's layout: this rank's shard with zeros appended along ``dim``."""
    return _with_attributes(_pad_end(param.detach(), dim, local_size), param)


def _pad_full(param: nn.Parameter, dim: int, full_size: int, rank: int, tp: int) -> nn.Parameter:
    """Head-aligned: gather over TP, zero-pad the full tensor, keep this rank's slice."""
    padded = _pad_end(full_tensor(param), dim, full_size)
    return _with_attributes(shard_for_rank(padded, dim, rank, tp), param)


def _pad_replicated_bias(bias: nn.Parameter, local_old: int, local_new: int) -> nn.Parameter:
    """A gathered Column's full bias laid out like its gathered, per-rank-padded output."""
    pieces = bias.detach().split(local_old)
    return _with_attributes(torch.cat([_pad_end(p, 0, local_new) for p in pieces]), bias)


def _pad_layer(
    module: ColumnParallelLinear | RowParallelLinear,
    n_heads: int,
    n_padded: int,
    head_aligned: bool,
) -> None:
    rank, tp = tensor_parallel_rank_and_size(module.tensor_parallel_group)
    name = type(module).__name__
    if module.stride != 1:
        raise ValueError(f"pad_model cannot pad {name} with stride {module.stride}")
    if module.pad_size:
        raise ValueError(
            f"pad_model cannot pad {name} built with pad=True ({module.pad_size} zero "
            "features already); build it without pad"
        )
    column = isinstance(module, ColumnParallelLinear)
    size = module.output_size if column else module.input_size
    local = size // tp
    if head_aligned and size % n_heads:
        raise ValueError(
            f"pad_model: {name} size {size} is not a multiple of n_heads({n_heads}); wrap only "
            f"the attention classes (wrapped_classes=...)"
        )
    if local * n_padded % n_heads:
        raise ValueError(
            f"pad_model: {name} shard size {local} x {n_padded}/{n_heads} heads is not an "
            f"integer; wrap only the attention classes (wrapped_classes=...)"
        )
    new_local = local * n_padded // n_heads
    dim = 0 if column else 1
    layout = HEAD_ALIGNED if head_aligned else PER_RANK
    padding = TensorParallelPadding(dim, size, new_local * tp, layout, tp)
    with torch.no_grad():
        if head_aligned:
            module.weight = _pad_full(module.weight, dim, new_local * tp, rank, tp)
        else:
            module.weight = _pad_local(module.weight, dim, new_local)
        bias = module.bias
        if column and bias is not None:
            # gather_output: the full, replicated bias (a sharding attribute torch's stubs lack)
            if not bias.tensor_model_parallel:  # type: ignore[attr-defined]
                module.bias = (
                    _with_attributes(_pad_end(bias.detach(), 0, new_local * tp), bias)
                    if head_aligned
                    else _pad_replicated_bias(bias, local, new_local)
                )
            elif head_aligned:
                module.bias = _pad_full(bias, 0, new_local * tp, rank, tp)
            else:
                module.bias = _pad_local(bias, 0, new_local)
    _mark(module.weight, padding)
    if column and module.bias is not None:  # a Column's biases grow along their dim 0
        _mark(module.bias, TensorParallelPadding(0, size, new_local * tp, layout, tp))
    if column:
        module.output_size, module.output_size_per_partition = new_local * tp, new_local
    else:
        module.input_size, module.input_size_per_partition = new_local * tp, new_local
    set_tensor_model_parallel_attributes(module.weight, True, dim, 1)
    module.master_weight = None
    logger.info("padded %s from %d to %d features", name, size, new_local * tp)


def pad_model(
    model: nn.Module,
    tp_degree: int,
    n_heads: int,
    wrapped_classes: Iterable[type] = (),
    pad_hook_fn: Callable[[nn.Module, float], Any] | None = None,
    *,
    head_aligned: bool = False,
) -> nn.Module:
    """Pad every Column/RowParallelLinear of ``model`` (only inside instances of
    ``wrapped_classes`` if given) from ``n_heads`` to ``n_heads +
    get_number_of_extra_heads(n_heads, tp_degree)`` heads; see the module docstring for the
    two layouts.

    As in NxD, ``pad_hook_fn(module, n_padded / n_heads)`` is called on every module of the
    padded region (children before their parent): the place to update head counts or a
    ``split_size``. Every TP rank must call it (``head_aligned`` gathers weights). Returns
    ``model``, modified in place; build the optimizer afterwards (parameters are replaced).
    Each padded weight and bias is marked with ``tensor_parallel_padding``
    (:class:`TensorParallelPadding`).
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
        if pad_hook_fn is not None:
            pad_hook_fn(module, ratio)
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            _pad_layer(module, n_heads, n_padded, head_aligned)

    visit(model, not classes or isinstance(model, classes))
    return model
