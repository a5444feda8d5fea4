"""All-to-all (Ulysses) attention: trade the sequence split for a head split, attend, trade back.

Each of ``n`` ranks holds ``(B, H, S/n, D)``; an all-to-all over the context-parallel group
(scatter heads, gather sequence) gives each rank ``(B, H/n, S, D)``: whole sequences for a
``1/n`` share of the heads, on which attention is ordinary (torch's SDPA, causal mask and
grouped-query heads included). A second all-to-all returns the output to ``(B, Hq, S/n, D)``.
Both query and key/value head counts must be divisible by ``n`` (K/V travel with ``Hkv``
heads, never repeated). The sequence arrives in the ranks' split order (zigzag or contiguous,
see :mod:`~nxd_layers.context_parallel.split`) and is permuted to natural order before the
causal mask applies, and back after. Traffic per rank and direction: ``(n-1)/n`` of Q, K, V
and O forward; the same of their gradients backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from nxd_layers.context_parallel.split import context_parallel_indices
from nxd_state import collectives

__all__ = ["all_to_all_attention"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all(scatter_dim, gather_dim)``; its gradient is the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return collectives.all_to_all(x.contiguous(), group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        back = collectives.all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim)
        return back, None, None, None


def _order(seq_len: int, n: int, zigzag: bool, device: torch.device) -> torch.Tensor:
    """Global position of each row of the gathered (rank-major) sequence."""
    return torch.cat([context_parallel_indices(seq_len, n, j, zigzag, device) for j in range(n)])


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
    zigzag: bool = True,
) -> torch.Tensor:
    """Exact attention over the whole sequence by head-parallel all-to-all: ``q``
    ``(B, Hq, S/n, D)``, ``k, v`` ``(B, Hkv, S/n, D)`` split with ``zigzag`` as given; returns
    this rank's rows ``(B, Hq, S/n, D)``."""
    n = dist.get_world_size(group)
    hq, hkv = q.shape[1], k.shape[1]
    if hq % n != 0 or hkv % n != 0:
        raise ValueError(
            f"all-to-all attention splits heads over context_parallel_size({n}): query heads "
            f"({hq}) and key/value heads ({hkv}) must both be divisible by it; use ring "
            f"attention instead"
        )
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    seq_len = q.shape[2] * n
    qf, kf, vf = (_AllToAll.apply(t, group, 1, 2) for t in (q, k, v))
    order = _order(seq_len, n, zigzag, q.device)
    natural = torch.empty_like(order)
    natural[order] = torch.arange(seq_len, device=q.device)
    # Rows in rank order -> natural order (row i of the result is global position i).
    qf, kf, vf = (t.index_select(2, natural) for t in (qf, kf, vf))
    out = F.scaled_dot_product_attention(
        qf, kf, vf, is_causal=causal, scale=scale, enable_gqa=hq != hkv
    )
    out = out.index_select(2, order)  # natural -> rank order
    return _AllToAll.apply(out, group, 2, 1)
