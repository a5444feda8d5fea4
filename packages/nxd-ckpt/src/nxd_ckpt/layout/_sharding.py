"""How a rank's local tensor maps into the global (unsharded) tensor: a list of blocks.

The types live in :mod:`nxd_state.shards` and the derivation from a layer's sharding
attributes in :mod:`nxd_layers.checkpoint_shards` (nxd-layers' contract); this module keeps
their old names for nxd-ckpt, and the name of a tensor of unknown sharding.

A :class:`ShardSpec` says, for one tensor on one rank, which box of the local tensor equals
which box of the global tensor. With TP size t, TP rank r, partition dim d and stride s, the
local tensor holds chunks ``r, r + t, …, r + (s-1)t`` of the ``t·s`` equal chunks of the global
tensor along d (chunk size c = local size / s):

    local[j·c : (j+1)·c]  =  global[(j·t + r)·c : (j·t + r + 1)·c]     along d, j < s.

GQA K/V projections replicate each KV head ``kv_size_multiplier`` times before splitting; the
global tensor is the *unreplicated* one (what one process holds), and only the first copy of
each head is "primary" (written). A fused ``weight_qkv`` is the concatenation [Q; K; V] of the
global projections. Replicated (non-TP) tensors are one whole block held by every TP rank.

A parameter padded by ``nxd_layers.pad_model`` (marked ``tensor_parallel_padding``) is stored
*unpadded*: its global tensor is the one before padding, each block is cut to the runs of
real data the mark names and moved to unpadded coordinates, and the zeros belong to no block
(written nowhere, zero-filled on load). So it loads at any TP degree, padded or not, and
exports without the padding.

An expert parameter (``expert_model_parallel``, NxD's ``nxd_layers.moe`` marks) holds the
experts of its EP rank along dim 0, inside which the TP split above applies. With EP size e,
EP rank q and n local experts, every TP block moves to its experts' rows of the global tensor
(all E = n·e experts):

    local[i] (within a block)  =  global[q·n + i]     along dim 0, i < n,

so its global shape is (E, …) and loads at any EP degree dividing E. It is replicated over
the expert-DP group only (``ShardSpec.expert_parallel``), which picks its writers.
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
