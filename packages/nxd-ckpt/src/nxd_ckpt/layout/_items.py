"""Tensors to save or load, with where their local data lives.

A :class:`TensorItem` pairs a global tensor (category, name, dtype, :class:`ShardSpec`) with
the rank's local data. The data is either a whole local tensor (:class:`DenseSource`: a
parameter, a buffer, an optimizer state tensor) or a contiguous range of its row-major
flattening held in a flat buffer (:class:`FlatSource`: a ZeRO-1 shard). Both expose the
local boxes they hold, and a view of any box inside one of those: the same code then maps
local boxes to global boxes, for writing and for reading.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from nxd_ckpt.format._boxes import Box, flat_range_boxes, linear_index
from nxd_ckpt.layout._context import RankContext
from nxd_ckpt.layout._sharding import ShardSpec

__all__ = ["DenseSource", "FlatSource", "Piece", "TensorItem", "pieces"]


@dataclass
class DenseSource:
    """The whole local tensor."""

    tensor: torch.Tensor

    def boxes(self) -> list[Box]:
        return [Box.whole(tuple(self.tensor.shape))]

    def view(self, holder: Box, box: Box) -> torch.Tensor:
        return self.tensor.detach()[box.slices()]


@dataclass
class FlatSource:
    """Elements ``[param_start, param_start + numel)`` of vec(local tensor of ``local_shape``),
    stored at ``flat[shard_start : shard_start + numel]``."""

    flat: torch.Tensor
    shard_start: int
    param_start: int
    numel: int
    local_shape: tuple[int, ...]

    def boxes(self) -> list[Box]:
        return flat_range_boxes(self.local_shape, self.param_start, self.param_start + self.numel)

    def view(self, holder: Box, box: Box) -> torch.Tensor:
        """``box`` (inside ``holder``, one of :meth:`boxes`) as a view of the flat buffer."""
        start = self.shard_start + linear_index(self.local_shape, holder.offsets) - self.param_start
        base = self.flat.detach()[start : start + holder.numel].view(holder.shape)
        return base[box.relative_to(holder).slices()]


@dataclass
class TensorItem:
    """One global tensor and this rank's local data of it."""

    category: str
    name: str
    dtype: torch.dtype
    spec: ShardSpec
    source: DenseSource | FlatSource
    dp_replicated: bool = True
    """Every data-parallel rank holds the same data (False for ZeRO-1 shards)."""
    stable: bool = False
    """Changed in place only by optimizer steps (parameters, optimizer state): an async save
    with ``async_copy="before_step"`` may copy it after returning, before the next step."""


@dataclass
class Piece:
    """A box of the local data and the global box it equals."""

    local: torch.Tensor
    global_box: Box
    primary: bool


def pieces(item: TensorItem) -> list[Piece]:
    """Every (local view, global box) of the item: block ∩ held box, for each pair."""
    out = []
    for block in item.spec.blocks:
        for holder in item.source.boxes():
            common = block.local.intersect(holder)
            if common is None:
                continue
            delta = tuple(g - loc for g, loc in zip(block.global_offsets, block.local.offsets))
            out.append(
                Piece(item.source.view(holder, common), common.shifted(delta), block.primary)
            )
    return out


def is_writer(item: TensorItem, piece: Piece, ctx: RankContext) -> bool:
    """Whether this rank writes ``piece``: one rank among those holding the same data,
    picked by a hash of the tensor name and box, so writes spread over TP x DP replicas.

    The DP replicas of an expert tensor (``spec.expert_parallel``) are its expert-DP group
    (DP x CP / EP ranks holding the same experts): the other ranks of the DP group hold
    other experts, i.e. other global boxes, which they write themselves."""
    if not piece.primary:
        return False
    if item.spec.expert_parallel:
        dp_rank, dp_size = ctx.expert_dp_rank, ctx.expert_dp_size
    else:
        dp_rank, dp_size = ctx.dp_rank, ctx.dp_size
    tp_count = ctx.tp_size if item.spec.tp_replicated else 1
    dp_count = dp_size if item.dp_replicated else 1
    mine = (dp_rank if item.dp_replicated else 0) * tp_count + (
        ctx.tp_rank if item.spec.tp_replicated else 0
    )
    key = f"{item.category}/{item.name}@{piece.global_box.offsets}".encode()
    return zlib.crc32(key) % (tp_count * dp_count) == mine
