"""Manual partition mode without processes: stage assignment, containers across a cut, shared
weights, microbatch splitting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nxd_pipeline import PipelineStageModule, mark_weight_sharing
from nxd_pipeline._inputs import split_manual
from nxd_pipeline._manual import _pack, _unpack, assign_stages, even_partition
from nxd_pipeline._shared import shared_weights


def _linears(n: int) -> list[nn.Module]:
    return [nn.Linear(4, 4, bias=False) for _ in range(n)]


def test_even_partition_is_nxds_split() -> None:
    layers = _linears(7)
    # 7 // 3 = 2 per stage, the remainder on the last stage
    assert [even_partition(layers, 3)[layer] for layer in layers] == [0, 0, 1, 1, 2, 2, 2]
    assert assign_stages(layers, 7) == list(range(7))
    with pytest.raises(ValueError, match="2 layers cannot fill 3 pipeline stages"):
        even_partition(_linears(2), 3)


@pytest.mark.parametrize(
    ("stages", "pattern"),
    [
        ([0, 2, 1], r"stages \[0, 2, 1\].*follow the layer order"),
        ([0, 0, 2], r"stages \[0, 0, 2\].*at least one layer"),
        ([0, 1, 3], r"layer 2 \(Linear\) on stage 3; expected an int in \[0, 3\)"),
    ],
)
def test_bad_partitions_name_the_stages(stages: list[int], pattern: str) -> None:
    layers = _linears(3)
    with pytest.raises(ValueError, match=pattern):
        assign_stages(layers, 3, lambda ls, n: dict(zip(ls, stages)))


def test_non_modules_are_refused() -> None:
    with pytest.raises(TypeError, match="item 1 is a builtin_function_or_method"):
        assign_stages([nn.Linear(2, 2), torch.relu], 1)  # type: ignore[list-item]


def test_containers_cross_a_cut_unchanged() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2)
    for value in (x, [x, y], (x, y)):
        packed = _pack(value, stage=0)
        assert all(isinstance(t, torch.Tensor) for t in packed)
        assert packed[-1].numel() == 0  # the marker: no data, only its shape travels
        back = _unpack(packed)
        assert type(back) is type(value)
        if isinstance(value, torch.Tensor):
            assert back is x
        else:
            assert all(a is b for a, b in zip(back, value))
    for bad in ({"h": x}, [x, 3], [], None):
        with pytest.raises(TypeError, match="stage 1's last layer returned"):
            _pack(bad, stage=1)


def test_shared_weights_by_identity_and_by_mark() -> None:
    layers = _linears(4)
    layers[3].weight = layers[0].weight  # tied
    mark_weight_sharing([(layers[1], "weight"), (layers[2], "weight")], "middle")  # separate
    stage_of = [0, 0, 1, 1]
    on_rank0 = shared_weights(layers, stage_of, p=2, rank=0)
    on_rank1 = shared_weights(layers, stage_of, p=2, rank=1)
    assert [w.group for w in on_rank0] == [w.group for w in on_rank1] == ["tied:0.weight", "middle"]
    assert on_rank0[0].local is layers[0].weight
    assert on_rank1[0].local is layers[3].weight
    assert on_rank0[1].local is layers[1].weight
    assert on_rank1[1].local is layers[2].weight
    assert on_rank0[1].stages == (0, 1)
    # all on one rank: autograd sums the uses, nothing to communicate
    assert shared_weights(layers, [0, 0, 0, 0], p=1, rank=0) == []


def test_marked_copies_on_one_rank_must_be_tied() -> None:
    layers = _linears(3)
    mark_weight_sharing([(layers[0], "weight"), (layers[1], "weight"), (layers[2], "weight")])
    with pytest.raises(ValueError, match=r"\['0.weight', '1.weight'\] share a weight"):
        shared_weights(layers, [0, 0, 1], p=2, rank=0)


def test_mark_weight_sharing_checks_like_nxd() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"shape \(3, 4\), the group's first weight \(4, 4\)"):
        mark_weight_sharing([(a, "weight"), (b, "weight")], "g")
    c = nn.Linear(4, 4)
    mark_weight_sharing([(c, "weight")], "h")
    with pytest.raises(RuntimeError, match="'h' is already marked"):
        mark_weight_sharing([(c, "weight")], "h")
    assert PipelineStageModule.mark_weight_sharing is mark_weight_sharing  # NxD's spelling


def test_split_manual_follows_nxd_inputs_and_labels() -> None:
    x, z, y = torch.arange(8.0).reshape(4, 2), torch.zeros(4, 3), torch.arange(4)
    micro = split_manual({"inputs": [x, z], "labels": y}, 2)
    assert len(micro) == 2
    assert [t.shape for t in micro[1]["inputs"]] == [(2, 2), (2, 3)]
    torch.testing.assert_close(micro[1]["inputs"][0], x[2:])
    torch.testing.assert_close(micro[1]["labels"][0], y[2:])  # a tensor becomes a list of one
    assert split_manual({"inputs": x}, 4)[3]["labels"] is None
    with pytest.raises(ValueError, match=r"shape \(4, 2\).*num_microbatches=3"):
        split_manual({"inputs": x}, 3)
    with pytest.raises(TypeError, match="inputs must be a tensor or a list/tuple of tensors"):
        split_manual({"inputs": {"x": x}}, 1)
