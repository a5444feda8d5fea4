"""Gradient synchronisation without ZeRO: bucketed all-reduce, averaged over data parallelism.

g_i <- (1/n) Σ_r g_i^(r) over the n ranks of the data-parallel group, for every gradient; the
gradients are packed into flat buckets of at most ``bucket_cap_bytes`` (one dtype per bucket) so
that many small tensors cost few collectives. Sequence-parallel gradients (weights replicated
across TP whose inputs were split along the sequence) are summed over TP the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from nxd_state import collectives

__all__ = ["all_reduce_bucketed", "is_sequence_parallel_param"]

logger = logging.getLogger(__name__)


def is_sequence_parallel_param(param: torch.Tensor) -> bool:
    """True for params tagged by ``nxd_layers.mark_sequence_parallel_parameter``."""
    return bool(getattr(param, "sequence_parallel_enabled", False))


def _buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors, each at most ``cap_bytes`` (a single
    larger tensor gets a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and (
            tensor.dtype != current[0].dtype
            or tensor.device != current[0].device
            or size + nbytes > cap_bytes
        ):
            buckets.append(current)
            current, size = [], 0
        current.append(tensor)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def all_reduce_bucketed(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup,
    *,
    average: bool,
    bucket_cap_bytes: int = 25 * 2**20,
) -> None:
    """t_i <- Σ_r t_i^(r) (or the mean with ``average``) over ``group``, in place, bucketed."""
    size = collectives.group_size(group)
    if size == 1 or not tensors:
        return
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
    for bucket in _buckets(tensors, bucket_cap_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        collectives.all_reduce(flat, group=group)
        if average:
            flat.div_(size)
        start = 0
        for tensor in bucket:
            tensor.copy_(flat[start : start + tensor.numel()].view_as(tensor))
            start += tensor.numel()
    logger.debug("all-reduced %d tensors over a group of %d", len(tensors), size)
