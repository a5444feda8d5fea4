"""Gradient synchronisation without ZeRO: bucketed all-reduce, averaged over data parallelism.

g_i <- (1/n) Σ_r g_i^(r) over the n ranks of the data-parallel group, for every gradient; the
gradients are packed into flat buckets of at most ``bucket_cap_bytes`` (one dtype per bucket) so
that many small tensors cost few collectives. Sequence-parallel gradients (weights replicated
across TP whose inputs were split along the sequence) are summed over TP the same way.
"""

from __future__ import annotations

import torch

from nxd_state import collectives

__all__ = ["all_reduce_bucketed", "is_sequence_parallel_param"]

all_reduce_bucketed = collectives.all_reduce_bucketed


def is_sequence_parallel_param(param: torch.Tensor) -> bool:
    """True for params tagged by ``nxd_layers.mark_sequence_parallel_parameter``."""
    return bool(getattr(param, "sequence_parallel_enabled", False))
