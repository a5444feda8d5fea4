"""Dtype buckets: how ZeRO-1 splits a param group whose params have several dtypes.

A flat buffer holds one dtype, and real models mix them (bf16 linears, fp32 norms). The params
of a group are therefore partitioned by dtype, B_d = [p_i for p_i in group if dtype(p_i) = d],
in order of each dtype's first appearance, and every B_d gets its own padded flat layout (see
:class:`~nxd_optim._flat.FlatLayout`), master shard and collectives; the group's
hyper-parameters apply to all of its buckets. A single-dtype group is one bucket, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nxd_optim._flat import FlatLayout
from nxd_optim._param_views import ParamViews

__all__ = ["DtypeBucket", "split_by_dtype"]


@dataclass
class DtypeBucket:
    """The params of one dtype in one param group, flattened and sharded together."""

    group_index: int
    """Which param group the params belong to."""

    positions: tuple[int, ...]
    """Where the params sit in the group's ``params`` list, in flat order."""

    dtype: torch.dtype
    """The params' dtype (the dtype their gradients are reduced and they are gathered in)."""

    layout: FlatLayout
    """Offsets of the params in the padded flat buffer."""

    master: torch.Tensor
    """This rank's shard of the flat buffer in the optimizer dtype (what the inner optimizer
    steps; fp32 for bf16/fp16 params with master weights)."""

    views: ParamViews | None = None
    """The flat buffer the params are views of (``parameters_as_bucket_view``, CPU and CUDA),
    which the all-gather fills in place; None: the params keep their own storage."""

    reduce_buffer: torch.Tensor | None = field(default=None, repr=False)
    """Scratch: the flat gradient buffer kept between steps on CPU (see
    ``NeuronZero1Optimizer._reduce_buffer``); None until the first step, and elsewhere."""

    def params(self, group_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This bucket's params, picked out of its group's ``params`` list."""
        return [group_params[i] for i in self.positions]


def split_by_dtype(params: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """``[(dtype, positions)]``: the params' positions per dtype, dtypes in first-seen order."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for position, param in enumerate(params):
        by_dtype.setdefault(param.dtype, []).append(position)
    return [(dtype, tuple(positions)) for dtype, positions in by_dtype.items()]
