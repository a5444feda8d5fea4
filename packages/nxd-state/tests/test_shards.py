"""The shard type and the checkpoint protocol (nxd_state.shards): pure logic, no process group."""

from __future__ import annotations

import math

import pytest
import torch

from nxd_state import shards
from nxd_state.shards import (
    Block,
    Box,
    CheckpointState,
    CheckpointTensor,
    CheckpointTensors,
    RankContext,
    ShardSpec,
    current_rank_context,
    flat_range_boxes,
    part_spec,
)


@pytest.mark.parametrize(("start", "end"), [(0, 24), (1, 23), (5, 6), (7, 19), (12, 24), (3, 3)])
def test_flat_range_boxes_cover_the_range_once_in_flat_order(start: int, end: int) -> None:
    """Every element of [start, end) of vec(x) lies in exactly one box, in flat order."""
    shape = (2, 3, 4)
    flat = torch.arange(math.prod(shape)).reshape(shape)
    got = [
        int(v) for box in flat_range_boxes(shape, start, end) for v in flat[box.slices()].flatten()
    ]
    assert got == list(range(start, end))


def test_box_intersection_is_the_common_region() -> None:
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 3))
    assert a.intersect(b) == Box((2, 2), (2, 1))
    assert a.intersect(Box((4, 0), (1, 1))) is None
    assert a.contains(Box((1, 3), (2, 2)))
    assert not a.contains(b)


def test_part_spec_cuts_blocks_to_the_part_rows() -> None:
    """A 2-block spec (rows [0, 2) -> global [0, 2), rows [2, 4) -> global [4, 6)) cut to global
    rows [1, 5): local row 1 -> part row 0, local rows [2, 3) -> part row 3."""
    spec = ShardSpec(
        (6, 2),
        [Block(Box((0, 0), (2, 2)), (0, 0)), Block(Box((2, 0), (2, 2)), (4, 0))],
        tp_replicated=False,
    )
    part = part_spec(spec, 1, 4, "w")
    assert part.global_shape == (4, 2)
    assert part.blocks == [Block(Box((1, 0), (1, 2)), (0, 0)), Block(Box((2, 0), (1, 2)), (3, 0))]


def test_checkpoint_state_is_a_structural_protocol() -> None:
    """Any object with ``checkpoint_tensors`` is a CheckpointState (no base class to inherit)."""

    class Holder:
        def __init__(self) -> None:
            self.weight = torch.zeros(2, 3)

        def checkpoint_tensors(
            self, ctx: RankContext, *, for_load: bool = False
        ) -> CheckpointTensors:
            spec = ShardSpec((2, 3), [Block(Box.whole((2, 3)), (0, 0))], tp_replicated=True)
            return CheckpointTensors([CheckpointTensor("weight", self.weight, spec)])

    holder = Holder()
    assert isinstance(holder, CheckpointState)
    assert not isinstance(torch.nn.Linear(2, 2), CheckpointState)
    (tensor,) = holder.checkpoint_tensors(current_rank_context()).tensors
    assert tensor.tensor is holder.weight
    assert tensor.owner is None


def test_rank_context_without_a_process_group_is_a_world_of_one() -> None:
    ctx = current_rank_context()
    assert (ctx.rank, ctx.world_size, ctx.tp_size, ctx.dp_size) == (0, 1, 1, 1)
    assert shards.RankContext is RankContext
