"""How a rank's local tensor maps into the global (unsharded) tensor: a list of blocks.

The types live in :mod:`nxd_state.shards` and the derivation from a layer's sharding
attributes in :mod:`nxd_layers.checkpoint_shards` (nxd-layers' contract); this module keeps
their old names for nxd-ckpt, and the name of a tensor of unknown sharding.

The block arithmetic (TP chunks with stride, GQA replicas, padding, experts over EP) is
documented where it lives, :mod:`nxd_layers.checkpoint_shards`.
"""

from __future__ import annotations

from nxd_ckpt.layout._context import RankContext
from nxd_layers.checkpoint_shards import (
    GQALayout,
    expert_parallel_degree,
    gqa_spec,
    is_gqa,
    tensor_shard_spec,
)
from nxd_state.shards import (
    Block,
    ShardSpec,
    part_spec,
    rank_local_spec,
    shape_mismatch,
    spec_for_stored_shape,
)

__all__ = [
    "Block",
    "GQALayout",
    "ShardSpec",
    "expert_parallel_degree",
    "gqa_spec",
    "is_gqa",
    "part_spec",
    "rank_local_name",
    "rank_local_spec",
    "shape_mismatch",
    "spec_for_stored_shape",
    "spec_for_tensor",
]

spec_for_tensor = tensor_shard_spec
"""nxd-ckpt's name of :func:`nxd_layers.checkpoint_shards.tensor_shard_spec`."""


def rank_local_name(name: str, ctx: RankContext) -> str:
    """Stored name of a tensor of unknown sharding: one per (TP, PP) coordinate."""
    return f"{name}#tp{ctx.tp_rank:02d}pp{ctx.pp_rank:02d}"
