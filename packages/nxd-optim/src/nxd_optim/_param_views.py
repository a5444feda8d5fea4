"""Params as views of their bucket's flat buffer, so the all-gather writes straight into them.

A bucket's params p_1 … p_k are laid end to end in F = [vec(p_1), …, vec(p_k), 0 …] (the
bucket's :class:`~nxd_optim._flat.FlatLayout`, in the params' own dtype). With

    p_i.data = F[o_i : o_i + numel_i].view(shape_i)

the gathered F *is* the updated model: the all-gather fills F in place (on gloo as n broadcasts,
see ``nxd_state.collectives.all_gather``) and no unflatten copy or full-size temporary follows.
F replaces the params' own storage, so it costs no memory (plus < n padding elements).

The binding can be undone by the user: a param whose storage was replaced later (``p.data =
…``, ``load_state_dict(assign=True)``, ``model.to(dtype)``) no longer views F. Such a param is
updated by a copy from F after every gather, exactly as without views, so it is never left
stale. Only devices whose tensors own real memory (CPU, CUDA) bind; on XLA, where views are
emulated, the params keep their storage and get copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nxd_optim._flat import FlatLayout

__all__ = ["VIEW_DEVICE_TYPES", "ParamViews"]

# Device types whose tensors alias real memory, where a view written in place is the param.
VIEW_DEVICE_TYPES = frozenset({"cpu", "cuda"})


@dataclass(frozen=True)
class ParamViews:
    """The flat buffer F of one bucket and the views of it that the bucket's params hold."""

    flat: torch.Tensor
    """F, ``layout.padded_numel`` elements in the params' dtype."""

    views: tuple[torch.Tensor, ...]
    """``F[o_i : o_i + numel_i].view(shape_i)`` per param, in flat order."""

    @classmethod
    def bind(cls, params: Sequence[torch.Tensor], layout: FlatLayout) -> ParamViews:
        """F <- flat(params) (padding zeroed), then point every ``p.data`` at its view of F."""
        first = params[0]
        with torch.no_grad():
            flat = layout.flatten([p.detach() for p in params], first.dtype, first.device)
        views = tuple(
            flat[start : start + numel].view(shape)
            for start, numel, shape in zip(layout.offsets, layout.numels, layout.shapes)
        )
        for param, view in zip(params, views):
            param.data = view
        return cls(flat, views)

    def detached(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Positions of the params that no longer view F (their storage was replaced)."""
        return [
            i
            for i, (param, view) in enumerate(zip(params, self.views))
            if param.data_ptr() != view.data_ptr()
            or param.dtype != view.dtype
            or param.shape != view.shape
            or param.stride() != view.stride()
        ]

    @torch.no_grad()
    def update_detached(self, params: Sequence[torch.Tensor]) -> int:
        """p_i <- F's view of p_i for every param that no longer views F; how many there were."""
        stale = self.detached(params)
        for i in stale:
            params[i].copy_(self.views[i])
        return len(stale)
