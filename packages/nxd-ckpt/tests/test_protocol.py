"""The checkpoint protocol: nxd-ckpt saves and loads any object that describes its own state
(nxd_state.shards.CheckpointState), by the names and specs it gives, never asking its class."""

from __future__ import annotations

from pathlib import Path

import torch

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_ckpt.format import read_index
from nxd_state.shards import (
    Block,
    Box,
    CheckpointState,
    CheckpointTensor,
    CheckpointTensors,
    RankContext,
    ShardSpec,
)


class Holder:
    """Not a module: two tensors, the second also known under an alias (tied)."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(4, 3, generator=generator)
        self.bias = torch.randn(3, generator=generator)
        self.asked: list[bool] = []

    def checkpoint_tensors(self, ctx: RankContext, *, for_load: bool = False) -> CheckpointTensors:
        self.asked.append(for_load)
        tensors = [
            CheckpointTensor(
                name, tensor, ShardSpec(shape, [Block(Box.whole(shape), (0,) * len(shape))], True)
            )
            for name, tensor, shape in (("w", self.weight, (4, 3)), ("b", self.bias, (3,)))
        ]
        return CheckpointTensors(tensors, aliases={"b_tied": "b"})


def test_an_object_describing_its_state_round_trips_by_its_names(tmp_path: Path) -> None:
    saved, loaded = Holder(0), Holder(1)
    assert isinstance(saved, CheckpointState)
    save_checkpoint(tmp_path, "t", model=saved)
    assert sorted(read_index(tmp_path / "t").tensors["model"]) == ["b", "w"]
    load_checkpoint(tmp_path, "t", model=loaded)
    assert saved.asked == [False]
    assert True in loaded.asked  # a load asks for the tensors to fill
    torch.testing.assert_close(loaded.weight, saved.weight, rtol=0, atol=0)  # bit-exact copy
    torch.testing.assert_close(loaded.bias, saved.bias, rtol=0, atol=0)
