"""The two autograd collectives of a MoE layer, over the expert-parallel (EP) group.

* :func:`all_to_all_rows`: uneven all-to-all of row blocks (tokens to the ranks holding their
  experts); its gradient is the same all-to-all with the counts swapped (results back).
* :func:`all_reduce_sum`: ``Y = sum_r X_r`` on every rank, gradient ``dX_r = sum_r dY_r``
  (every rank uses ``Y``, so each one's contribution to the loss flows back to every input):
  the global token statistics of the auxiliary losses.

Both go through :mod:`nxd_state.collectives`; on a group of one (or ``None``) they are the
identity.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from nxd_state import collectives

__all__ = ["all_reduce_sum", "all_to_all_rows", "group_size"]


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` means no expert parallelism (one rank)."""
    return 1 if group is None else collectives.group_size(group)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: ProcessGroup,
        send_counts: list[int],
        recv_counts: list[int],
    ) -> torch.Tensor:
        ctx.group, ctx.counts = group, (send_counts, recv_counts)
        return collectives.all_to_all_uneven(
            x, group, send_counts=send_counts, recv_counts=recv_counts
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send_counts, recv_counts = ctx.counts
        back = collectives.all_to_all_uneven(
            grad.contiguous(), ctx.group, send_counts=recv_counts, recv_counts=send_counts
        )
        return back, None, None, None


def all_to_all_rows(
    x: torch.Tensor,
    group: ProcessGroup | None,
    send_counts: list[int],
    recv_counts: list[int],
) -> torch.Tensor:
    """Rows ``x`` (``send_counts[j]`` for rank ``j``, in rank order) exchanged over ``group``;
    returns the ``recv_counts[j]`` rows from each rank ``j``, in rank order."""
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, group, list(send_counts), list(recv_counts))


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return collectives.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return collectives.all_reduce(grad.clone(), ctx.group), None


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``sum_r x_r`` over ``group`` with gradient ``sum_r dY_r`` (see the module docstring)."""
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
