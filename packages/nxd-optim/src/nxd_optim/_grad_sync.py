"""Gradient synchronisation without ZeRO: bucketed all-reduce, averaged over data parallelism.

g_i <- (1/n) Σ_r g_i^(r) over the n ranks of the data-parallel group, for every gradient; the
gradients are packed into flat buckets of at most ``bucket_cap_bytes`` (one dtype per bucket) so
that many small tensors cost few collectives. Sequence-parallel gradients (weights replicated
across TP whose inputs were split along the sequence) are summed over TP the same way.
Expert weights (``expert_model_parallel``, different experts on the ranks of an EP group) are
told apart by :func:`is_expert_param`: they are averaged over the expert-DP group instead.
"""

from __future__ import annotations

import torch

from nxd_state import collectives

__all__ = [
    "EXPERT_ATTRIBUTES",
    "all_reduce_bucketed",
    "copy_expert_attributes",
    "is_expert_param",
    "is_sequence_parallel_param",
]

# Set by nxd_layers.moe on expert weights (dim 0 = experts, split over the EP group).
EXPERT_ATTRIBUTES = ("expert_model_parallel", "expert_partition_dim", "expert_model_parallel_size")

all_reduce_bucketed = collectives.all_reduce_bucketed


def is_sequence_parallel_param(param: torch.Tensor) -> bool:
    """True for params tagged by ``nxd_layers.mark_sequence_parallel_parameter``."""
    return bool(getattr(param, "sequence_parallel_enabled", False))


def is_expert_param(param: torch.Tensor) -> bool:
    """True for expert weights of ``nxd_layers.moe`` (marked ``expert_model_parallel``): each
    rank of an EP group holds different experts."""
    return bool(getattr(param, "expert_model_parallel", False))


def copy_expert_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the expert-parallel attributes of ``source`` (if any) onto ``destination``."""
    for name in EXPERT_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))
