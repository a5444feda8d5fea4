"""A layer's tensors as checkpoint shards (nxd_layers.checkpoint_shards): pure logic."""

from __future__ import annotations

import torch
from torch import nn

from nxd_layers import module_checkpoint_tensors, tensor_shard_spec
from nxd_state.shards import Block, Box, RankContext


def _ctx(tp_rank: int = 0, tp_size: int = 1) -> RankContext:
    return RankContext(0, 1, tp_rank, tp_size, 0, 1, 0, 1, 0, False)


def test_a_strided_partition_holds_chunks_r_and_r_plus_t() -> None:
    """TP rank 1 of 2, dim 0, stride 2, local rows 4 (chunk c = 2): local[0:2] = global[2:4]
    (chunk j·t + r = 1) and local[2:4] = global[6:8] (chunk 3), global rows 4·2 = 8."""
    weight = torch.zeros(4, 3)
    weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    weight.partition_dim = 0  # type: ignore[attr-defined]
    weight.partition_stride = 2  # type: ignore[attr-defined]
    spec = tensor_shard_spec(weight, tp_rank=1, tp_size=2)
    assert spec.global_shape == (8, 3)
    assert spec.blocks == [Block(Box((0, 0), (2, 3)), (2, 0)), Block(Box((2, 0), (2, 3)), (6, 0))]
    assert not spec.tp_replicated
    assert spec.info == {"partition_dim": 0, "partition_stride": 2, "tp_size": 2}


def test_an_unmarked_tensor_is_one_whole_block_every_tp_rank_holds() -> None:
    spec = tensor_shard_spec(torch.zeros(2, 5), tp_rank=1, tp_size=4)
    assert spec.global_shape == (2, 5)
    assert spec.blocks == [Block(Box.whole((2, 5)), (0, 0))]
    assert spec.tp_replicated


def test_the_walk_lists_a_tied_tensor_once_and_its_other_name_as_an_alias() -> None:
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight  # tied
    walked = module_checkpoint_tensors([model], _ctx())
    assert [t.name for t in walked.tensors] == ["0.weight"]
    assert walked.aliases == {"1.weight": "0.weight"}
    assert walked.tensors[0].tensor is model[0].weight
    assert walked.tensors[0].owner is model[0]
    assert module_checkpoint_tensors([model], _ctx(), owners=False).tensors[0].owner is None
