"""``base_optimizer`` as NxD's tests read it: one shard per parameter.

The inner optimizer steps one flat master shard per dtype bucket (``M_r``, see
:mod:`nxd_optim._flat`). torch-xla's ZeRO-1, which NxD's tests were written against, holds one
shard per parameter, and those tests zip ``opt.param_groups[g]["params"]`` with
``opt.base_optimizer.param_groups[g]["params"]`` to compute a norm over the shards' gradients.
So :class:`BaseOptimizerView` is the inner optimizer (every attribute read or written goes to
it, ``isinstance`` sees its class) except for ``param_groups``: per param ``p_i`` of group
``g``, in order, this rank's piece of ``vec(p_i)`` in ``M_r`` (a 1-D view sharing its
storage, empty when ``p_i`` lies in other ranks' shards), with ``.grad`` the same piece of the
gradient shard when there is one. Over the sharding group the pieces of ``p_i`` partition
``vec(p_i)`` exactly once, so any sum over elements (a norm reduced over the sharding group,
as ``get_grad_norm(zero1_optimizer=True)`` does) equals the one over torch-xla's shards;
their sizes differ (torch-xla pads each parameter to n equal pieces).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["BaseOptimizerView"]


class BaseOptimizerView:
    """The inner optimizer with per-parameter ``param_groups`` (module docstring)."""

    def __init__(self, owner: Any, inner: Optimizer) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_inner", inner)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(view, torch.optim.AdamW) as for the inner one
        return type(object.__getattribute__(self, "_inner"))

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        # NxD's tests patch ``base_optimizer.zero_grad``; the step calls the patched one.
        setattr(object.__getattribute__(self, "_inner"), name, value)

    def __repr__(self) -> str:
        return f"BaseOptimizerView({object.__getattribute__(self, '_inner')!r})"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Per outer group: the inner group's hyper-parameters and, per param in order, its
        piece of this rank's master shard (see the module docstring). Built on each read."""
        owner = object.__getattribute__(self, "_owner")
        inner = object.__getattribute__(self, "_inner")
        pieces: dict[tuple[int, int], torch.Tensor] = {}
        for bucket in owner.dtype_buckets:
            master = bucket.master.detach()
            grad = bucket.master.grad
            found = {p.param_index: p for p in bucket.layout.pieces(owner.sharding_rank)}
            for index, position in enumerate(bucket.positions):
                piece = found.get(index)
                lo, hi = (piece.shard_start, piece.shard_start + piece.numel) if piece else (0, 0)
                view = master[lo:hi]
                if grad is not None:
                    view.grad = grad.detach()[lo:hi]
                pieces[(bucket.group_index, position)] = view
        groups = []
        for index, (group, inner_group) in enumerate(
            zip(owner.param_groups, inner.param_groups, strict=True)
        ):
            hyper = {k: v for k, v in inner_group.items() if k != "params"}
            params = [pieces[(index, position)] for position in range(len(group["params"]))]
            groups.append({**hyper, "params": params})
        return groups
