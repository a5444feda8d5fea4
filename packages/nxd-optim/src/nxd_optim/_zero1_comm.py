"""How ZeRO-1 moves a flat bucket: the gradient reduction and the parameter gather, per backend.

With n ranks, a flat buffer F of L = n·S elements and rank r owning F[rS : (r+1)S], a step
needs Σ_k F^(k)[rS : (r+1)S] on rank r (the summed gradient shard) and, after the update,
every rank's shard on every rank. Two ways to get the summed shard:

* ``reduce_scatter``: rank r receives only its shard; (n-1)/n·B bytes sent per rank. Native on
  NCCL and XLA; on gloo ``nxd_state.collectives.reduce_scatter`` is an all-to-all and a local
  sum, the same volume (torch's own gloo reduce-scatter is an all-reduce of a copy).
* ``all_reduce``: every rank receives the whole sum and keeps its slice; 2(n-1)/n·B sent, but
  the clipping norm then needs no collective over the sharding group (every rank holds the
  whole gradient), where a reduce-scatter needs one more, scalar, all-reduce.

``"auto"`` picks ``reduce_scatter`` except on gloo with fewer than
:data:`GLOO_REDUCE_SCATTER_MIN_RANKS` ranks. Measured on the shared 2-core machine (whole
ZeRO-1 steps of the benchmark's 2.4 MB model, paired per round, median ratio reduce-scatter /
all-reduce, with and without clipping): 1.25 and 1.19 at 2 ranks, 0.95 and 0.91 at 3, 0.89 and
0.82 at 4. At 2 ranks the all-to-all's receive buffer and the scalar norm collective cost more
than the halved volume saves (gloo runs every collective through its worker threads, and on a
loaded CPU a wake-up costs about as much as moving a megabyte). The traffic counter of
``nxd_state.collectives`` records the op that ran and its bytes.

A positive ``max_numel`` splits a collective into pieces of at most that many elements: the
flat buffer is viewed as an (n, S) matrix and moved in column blocks, so each piece is itself
a reduce-scatter (or all-gather) whose row r is rank r's part (torch-xla's
``bucket_cap_mb_reduce_scatter`` / ``bucket_cap_mb_all_gather``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from nxd_state import collectives

__all__ = [
    "GRAD_REDUCTIONS",
    "GradReduction",
    "all_gather_flat",
    "all_gather_flat_into",
    "reduce_flat",
    "resolve_grad_reduction",
]

GradReduction = Literal["auto", "reduce_scatter", "all_reduce"]
GRAD_REDUCTIONS = ("auto", "reduce_scatter", "all_reduce")
# Below this many ranks, "auto" all-reduces on gloo (see the module docstring).
GLOO_REDUCE_SCATTER_MIN_RANKS = 3


def resolve_grad_reduction(requested: str, group: ProcessGroup) -> str:
    """``requested`` with ``"auto"`` replaced by the faster primitive for ``group``'s backend
    and size."""
    if requested not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {requested!r}")
    if requested != "auto":
        return requested
    backend = str(dist.get_backend(group)).lower()
    small = dist.get_world_size(group) < GLOO_REDUCE_SCATTER_MIN_RANKS
    return "all_reduce" if backend == "gloo" and small else "reduce_scatter"


def _column_blocks(shard_numel: int, max_numel: int, n: int) -> list[slice]:
    """Column ranges of the (n, S) view such that each block holds <= max_numel elements."""
    if max_numel <= 0 or n * shard_numel <= max_numel:
        return [slice(0, shard_numel)]
    width = max(1, max_numel // n)
    return [slice(j, min(j + width, shard_numel)) for j in range(0, shard_numel, width)]


def reduce_flat(
    flat: torch.Tensor, group: ProcessGroup, mode: str, max_numel: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(shard, full)``: this rank's shard of Σ_k F^(k), and with ``all_reduce`` the whole sum
    (``flat`` itself, reduced in place; ``shard`` is then a view of it). ``full`` is None after
    a reduce-scatter. ``flat`` must be a temporary: it is overwritten."""
    n, rank = collectives.group_size(group), collectives.group_rank(group)
    shard_numel = flat.numel() // n
    if n == 1:
        return flat, flat
    if mode == "all_reduce":
        for block in _column_blocks(shard_numel, max_numel, n):
            start, stop = block.start * n, block.stop * n  # contiguous pieces of the same size
            collectives.all_reduce(flat[start:stop], group=group)
        return flat[rank * shard_numel : (rank + 1) * shard_numel], flat
    blocks = _column_blocks(shard_numel, max_numel, n)
    if len(blocks) == 1:
        return collectives.reduce_scatter(flat, group=group), None
    matrix = flat.view(n, shard_numel)
    shard = torch.empty(shard_numel, dtype=flat.dtype, device=flat.device)
    for block in blocks:
        piece = matrix[:, block].contiguous().view(-1)  # row r = rank r's part of this block
        shard[block] = collectives.reduce_scatter(piece, group=group)
    return shard, None


def all_gather_flat(shard: torch.Tensor, group: ProcessGroup, max_numel: int = 0) -> torch.Tensor:
    """F = [shard_0, …, shard_{n-1}]: every rank's shard, in rank order."""
    n = collectives.group_size(group)
    blocks = _column_blocks(shard.numel(), max_numel, n)
    if len(blocks) == 1:
        return collectives.all_gather(shard.contiguous(), group)
    full = torch.empty(n, shard.numel(), dtype=shard.dtype, device=shard.device)
    for block in blocks:
        gathered = collectives.all_gather(shard[block].contiguous(), group)
        full[:, block] = gathered.view(n, -1)
    return full.view(-1)


def all_gather_flat_into(flat: torch.Tensor, group: ProcessGroup, max_numel: int = 0) -> None:
    """F <- [F_0, …, F_{n-1}] in place, F_k = rank k's shard of its own F (this rank's shard
    must already be in place). One in-place all-gather (n broadcasts on gloo); with a cap, column
    blocks gathered through a temporary each."""
    n, rank = collectives.group_size(group), collectives.group_rank(group)
    shard_numel = flat.numel() // n
    blocks = _column_blocks(shard_numel, max_numel, n)
    if len(blocks) == 1:
        collectives.all_gather(flat[rank * shard_numel : (rank + 1) * shard_numel], group, out=flat)
        return
    matrix = flat.view(n, shard_numel)
    for block in blocks:
        gathered = collectives.all_gather(matrix[rank, block], group)  # a contiguous row piece
        matrix[:, block] = gathered.view(n, -1)
