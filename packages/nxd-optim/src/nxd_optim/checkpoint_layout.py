"""ZeRO-1's flat layout, described for checkpoints (:class:`nxd_state.shards.FlatShardedState`).

A ZeRO-1 optimizer flattens its params into buckets (one per param group, or per dtype within a
group): the bucket's params p_1 … p_k lie end to end in a flat vector zero-padded to n·S
elements (S = ceil(Σ numel / n)), rank r holds elements [rS, (r+1)S) as its master shard, and
the inner optimizer keeps state tensors shaped like that shard. :func:`flat_buckets` reads them
from the public ``dtype_buckets``, each shard's size checked against that layout, so a
checkpoint stores each parameter's state as a global tensor and never re-derives the layout.

:class:`~nxd_optim.NeuronEPZero1Optimizer` is two such optimizers: the dense params over the
n = DP x CP ranks, the expert params (this EP rank's experts) over the m = n/EP ranks of the
expert-DP group; each half is checked to be sharded as the current layout says.
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_optim._grad_sync import is_expert_param
from nxd_state.shards import FlatBucket, FlatCheckpointLayout, FlatShardGroup, RankContext

__all__ = ["ep_zero1_checkpoint_layout", "flat_buckets", "zero1_checkpoint_layout"]

_NOT_SHARDED = "the ZeRO-1 optimizer has not sharded its params yet (lazy_init): call init_zero()"


def _inner(zero: Any) -> torch.optim.Optimizer:
    """The optimizer stepping the master shards (torch-xla's ``base_optimizer``)."""
    inner: torch.optim.Optimizer = getattr(zero, "base_optimizer", None) or zero.inner_optimizer
    return inner


def flat_buckets(zero: Any) -> list[FlatBucket]:
    """The flat buffers of a ZeRO-1 optimizer, from its public ``dtype_buckets`` (group index,
    positions in the group, master shard), each shard's size checked against the layout."""
    if getattr(zero, "inited", True) is False:
        raise RuntimeError(_NOT_SHARDED)
    n, rank = int(zero.sharding_size), int(zero.sharding_rank)
    groups = zero.param_groups
    buckets = [
        FlatBucket(b.group_index, b.params(groups[b.group_index]["params"]), b.master, n, rank)
        for b in zero.dtype_buckets
    ]
    for bucket in buckets:
        expected = -(-sum(p.numel() for p in bucket.params) // n)
        if bucket.master.dim() != 1 or bucket.master.numel() != expected:
            raise RuntimeError(
                f"ZeRO-1 bucket of group {bucket.group_index}: master shard of shape "
                f"{tuple(bucket.master.shape)}, expected ({expected},) for params "
                f"{bucket.shapes} over {n} ranks: the flat layout is not the one described"
            )
    return buckets


def _group(zero: Any) -> FlatShardGroup:
    return FlatShardGroup(zero, _inner(zero), flat_buckets(zero))


def zero1_checkpoint_layout(zero: Any, ctx: RankContext, *, exact: bool) -> FlatCheckpointLayout:
    """A ``NeuronZero1Optimizer``'s one flat layout over DP x CP. ``exact``: the optimizer is
    that class itself (a subclass may shard otherwise). At EP > 1 expert shards are cut over
    the expert-DP group, which only ``NeuronEPZero1Optimizer`` does (and says through its
    halves): expert params here, or a subclass, are refused."""
    params = [p for group in zero.param_groups for p in group["params"]]
    if not exact or any(map(is_expert_param, params)):
        ctx.refuse_expert_parallel(
            f"checkpointing the ZeRO-1 optimizer {type(zero).__name__} over expert parameters",
            "nxd-ckpt reads ZeRO-1 shards of expert parameters only from "
            "NeuronEPZero1Optimizer (expert state over the expert-DP group; NxDOptimizer "
            "with zero_one_enabled=True builds it at EP > 1) or, without ZeRO-1, from "
            "NxDOptimizer with zero_one_enabled=False",
        )
    return FlatCheckpointLayout(
        zero,
        [_group(zero)],
        zero.optimizer_class.__name__,
        bool(zero.use_master_weights_in_ckpt),
    )


def ep_zero1_checkpoint_layout(core: Any, ctx: RankContext) -> FlatCheckpointLayout:
    """A ``NeuronEPZero1Optimizer``'s halves, checked to be sharded over the groups of the
    current layout: the dense half over DP x CP, the expert half over expert-DP."""
    if not core.inited:
        raise RuntimeError(_NOT_SHARDED)
    dense, experts = core.non_ep_zero_optimizer, core.ep_zero_optimizer
    if dense is not None and ctx.ep_size > 1:
        count = sum(is_expert_param(p) for g in dense.param_groups for p in g["params"])
        if count:
            raise NotImplementedError(
                f"NeuronEPZero1Optimizer holds {count} expert parameter(s) in its dense half at "
                f"expert_model_parallel_size={ctx.ep_size}: it was built at another EP degree; "
                f"build the optimizer after initialize_model_parallel"
            )
    halves = []
    for half, size, rank, what in (
        (dense, ctx.dp_size, ctx.dp_rank, "non_ep_zero_optimizer (dense, over DP x CP)"),
        (experts, ctx.expert_dp_size, ctx.expert_dp_rank, "ep_zero_optimizer (over expert-DP)"),
    ):
        if half is None:
            continue
        got = (int(half.sharding_size), int(half.sharding_rank))
        if got != (size, rank):
            raise RuntimeError(
                f"NeuronEPZero1Optimizer.{what} is sharded as rank {got[1]} of {got[0]}, the "
                f"current parallel state expects rank {rank} of {size}: the optimizer was "
                f"built under another parallel state"
            )
        halves.append(_group(half))
    return FlatCheckpointLayout(
        core, halves, core.optimizer_class.__name__, bool(core.use_master_weights_in_ckpt)
    )
