"""The dispatch plan: which (token, choice) assignments are kept, and where their rows go.

Assignments are numbered token-major, ``a = t * k + j`` for token ``t`` and its ``j``-th
choice, on each rank; across the EP group the order is rank-major (the tokens of EP rank 0,
then rank 1, ...), i.e. the order of the concatenated batch in one process.

* **Dropless** (``capacity_factor=None``): every assignment is kept.
* **Capacity** ``c``: each expert takes at most ``C = min(ceil(T_g k c / E), T_g)``
  assignments (``T_g``: tokens of the whole EP group); an expert's assignments are served in
  assignment order, so on a tie for the last slots the earlier token wins, deterministically
  (NxD's ``cumsum`` rule). The global position of an assignment in its expert is its
  position among this rank's assignments to that expert plus the count of lower EP ranks
  (one all-gather of the ``(E,)`` counts), so the kept set equals the one-process set.

Kept assignments are sorted by expert (stable: token order inside an expert); experts
``[r E/ep, (r+1) E/ep)`` live on EP rank ``r``, so the sorted rows split into contiguous
blocks, one per destination rank: the all-to-all's send counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from nxd_layers.moe._comm import group_size
from nxd_state import collectives

__all__ = ["DispatchPlan", "expert_capacity", "plan_dispatch"]


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``C = min(ceil(T k c / E), T)``: the most assignments one expert takes."""
    return min(math.ceil(tokens * top_k * capacity_factor / num_experts), tokens)


@dataclass(frozen=True)
class DispatchPlan:
    """One rank's routing of one forward pass."""

    order: torch.Tensor
    """(N,) kept assignment numbers ``t * k + j``, sorted by expert (token order inside)."""
    send_counts: list[int]
    """Rows of ``order`` for each EP rank (its experts' block)."""
    recv_counts: list[int]
    """Rows arriving from each EP rank."""
    recv_expert: torch.Tensor
    """(R,) local expert of each arriving row (rank-major, then expert, then token order)."""
    local_experts: int
    """Experts on this rank, ``E / ep``."""
    dropped: int
    """Assignments of this rank dropped for capacity."""


def plan_dispatch(
    expert_index: torch.Tensor,
    num_experts: int,
    capacity_factor: float | None,
    group: ProcessGroup | None,
) -> DispatchPlan:
    """The plan for ``expert_index`` (T, k) over the EP ``group`` (``None``: one rank)."""
    ep = group_size(group)
    me = 0 if ep == 1 else collectives.group_rank(group)
    local = num_experts // ep
    _tokens, top_k = expert_index.shape
    flat = expert_index.reshape(-1)  # (T k,) expert of each assignment
    onehot = F.one_hot(flat, num_experts)  # (T k, E)
    counts = onehot.sum(0, keepdim=True)  # (1, E)
    if ep > 1:
        counts = collectives.all_gather(counts, group, dim=0)  # (ep, E)
    if capacity_factor is None:
        kept_counts = counts
        keep = torch.ones_like(flat, dtype=torch.bool)
    else:
        total_tokens = int(counts.sum()) // top_k
        cap = expert_capacity(total_tokens, top_k, num_experts, capacity_factor)
        before = counts.cumsum(0) - counts  # (ep, E) assignments of lower EP ranks
        kept_counts = (cap - before).clamp(min=0).minimum(counts)
        # 0-based position of each assignment in its expert over the whole group.
        position = (onehot.cumsum(0) * onehot).sum(1) - 1 + before[me][flat]
        keep = position < cap
    kept = keep.nonzero().squeeze(1)
    order = kept[torch.sort(flat[kept], stable=True).indices]
    mine = kept_counts[:, me * local : (me + 1) * local]  # (ep, local) rows coming here
    recv_expert = torch.arange(local, device=flat.device).repeat(ep)
    return DispatchPlan(
        order=order,
        send_counts=kept_counts[me].reshape(ep, local).sum(1).tolist(),
        recv_counts=mine.sum(1).tolist(),
        recv_expert=recv_expert.repeat_interleave(mine.reshape(-1)),
        local_experts=local,
        dropped=int(flat.numel() - kept.numel()),
    )
