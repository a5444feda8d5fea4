"""Split a batch along the sequence for context parallelism, and gather it back.

With ``n`` context-parallel ranks and ``zigzag`` (the default, what causal ring attention needs
for balanced work) the sequence is cut into ``2n`` equal chunks and rank ``r`` holds chunks
``r`` and ``2n - 1 - r``, in that order: a causal row's work (its position) then sums to the
same for every rank. Without ``zigzag`` rank ``r`` holds the ``r``-th of ``n`` contiguous
chunks. Inputs, labels (already shifted to the next token, *before* the split) and position
ids (for rotary embeddings by *global* position) are split the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from nxd_state import collectives

__all__ = [
    "check_sequence_length",
    "context_parallel_indices",
    "context_parallel_position_ids",
    "gather_from_context_parallel",
    "split_batch_for_context_parallel",
    "split_for_context_parallel",
]


def check_sequence_length(seq_len: int, cp_size: int, zigzag: bool = True) -> int:
    """The local sequence length ``seq_len / cp_size``, or a clear error when the split is not
    exact (``2 * cp_size`` chunks with zigzag)."""
    chunks = 2 * cp_size if zigzag else cp_size
    if seq_len % chunks != 0:
        what = (
            f"2 x context_parallel_size({cp_size}) = {chunks}"
            if zigzag
            else (f"context_parallel_size({cp_size})")
        )
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {what}"
            f"{' (the zigzag split of causal ring attention)' if zigzag else ''}; pad the "
            f"sequence to a multiple of {chunks}"
        )
    return seq_len // cp_size


def context_parallel_indices(
    seq_len: int,
    cp_size: int,
    cp_rank: int,
    zigzag: bool = True,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Global positions held by ``cp_rank``, in local order (a ``long`` tensor of
    ``seq_len / cp_size``)."""
    local = check_sequence_length(seq_len, cp_size, zigzag)
    if not zigzag:
        return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=device)
    chunk = local // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last_chunk = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last_chunk * chunk, (last_chunk + 1) * chunk, device=device)
    return torch.cat([first, second])


def _size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def split_for_context_parallel(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 1, zigzag: bool = True
) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (the sequence): a copy, not a view."""
    n, r = _size_rank(group)
    if n == 1:
        return x
    index = context_parallel_indices(x.shape[dim], n, r, zigzag, device=x.device)
    return x.index_select(dim, index)


def context_parallel_position_ids(
    seq_len: int,
    group: ProcessGroup | None,
    zigzag: bool = True,
    batch_size: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``(batch_size, seq_len / n)`` global positions of this rank's tokens (rotary by global
    position)."""
    n, r = _size_rank(group)
    index = context_parallel_indices(seq_len, n, r, zigzag, device=device)
    return index.unsqueeze(0).expand(batch_size, -1)


def split_batch_for_context_parallel(
    batch: Mapping[str, torch.Tensor],
    group: ProcessGroup | None,
    zigzag: bool = True,
    keys: tuple[str, ...] = ("input_ids", "labels", "position_ids", "attention_mask"),
) -> dict[str, torch.Tensor]:
    """``batch`` with ``keys`` (``(batch, sequence, ...)`` tensors) split along the sequence;
    ``position_ids`` are added (global positions) when absent. Other entries pass through."""
    out = dict(batch)
    seq_len = None
    for key in keys:
        if key in batch:
            seq_len = batch[key].shape[1]
            out[key] = split_for_context_parallel(batch[key], group, dim=1, zigzag=zigzag)
    if seq_len is not None and "position_ids" not in batch:
        ref = batch[next(k for k in keys if k in batch)]
        out["position_ids"] = context_parallel_position_ids(
            seq_len, group, zigzag, ref.shape[0], device=ref.device
        )
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int, zigzag: bool
    ) -> torch.Tensor:
        n = _size_rank(group)[0]
        ctx.group, ctx.dim, ctx.zigzag = group, dim, zigzag
        gathered = collectives.all_gather(x.contiguous(), group, dim=dim)
        seq_len = gathered.shape[dim]
        order = torch.cat(
            [context_parallel_indices(seq_len, n, j, zigzag, x.device) for j in range(n)]
        )
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(seq_len, device=x.device)
        return gathered.index_select(dim, inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return split_for_context_parallel(grad, ctx.group, ctx.dim, ctx.zigzag), None, None, None


def gather_from_context_parallel(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 1, zigzag: bool = True
) -> torch.Tensor:
    """The whole sequence in natural order from every rank's slice (all-gather and reorder);
    its gradient is this rank's slice of the incoming one."""
    if _size_rank(group)[0] == 1:
        return x
    return _Gather.apply(x, group, dim, zigzag)
