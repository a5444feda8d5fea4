"""Context parallelism: attention over a sequence split across ranks, and the split itself.

* :func:`ring_attention`: K/V blocks passed around the ring, online-softmax merge, zigzag
  split for causal balance, dK/dV passed around the ring in backward.
* :func:`all_to_all_attention`: Ulysses, sequence <-> heads by all-to-all (heads divisible by
  the CP degree).
* :func:`context_parallel_attention`: either, by name, on the current state's CP group.
* :mod:`~nxd_layers.context_parallel.split`: split inputs/labels/positions, gather outputs.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from nxd_layers.context_parallel.all_to_all import all_to_all_attention
from nxd_layers.context_parallel.ring import ring_attention
from nxd_layers.context_parallel.split import (
    check_sequence_length,
    context_parallel_indices,
    context_parallel_position_ids,
    gather_from_context_parallel,
    split_batch_for_context_parallel,
    split_for_context_parallel,
)

__all__ = [
    "ALGORITHMS",
    "all_to_all_attention",
    "check_sequence_length",
    "context_parallel_attention",
    "context_parallel_indices",
    "context_parallel_position_ids",
    "gather_from_context_parallel",
    "ring_attention",
    "split_batch_for_context_parallel",
    "split_for_context_parallel",
]

ALGORITHMS = ("ring", "all_to_all")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    algorithm: str = "ring",
    group: ProcessGroup | None = None,
    causal: bool = True,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of this rank's sequence slice (zigzag split) against the whole sequence.

    ``group`` defaults to the current state's CP group; with one rank it is torch's SDPA.
    ``algorithm``: ``"ring"`` or ``"all_to_all"``; ``kernel`` (ring only): see
    :mod:`~nxd_layers.context_parallel._blocks`.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"context-parallel algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
        )
    if group is None:
        from nxd_state import get_parallel_state

        group = get_parallel_state().context_parallel_group
    if dist.get_world_size(group) == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    if algorithm == "ring":
        return ring_attention(q, k, v, group, causal=causal, scale=scale, kernel=kernel)
    return all_to_all_attention(q, k, v, group, causal=causal, scale=scale)
