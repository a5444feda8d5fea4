"""Logic without communication: the flat padded layout and the pickle-free state format."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from nxd_optim._flat import FlatLayout
from nxd_optim._state_io import read_state, write_state


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_pieces_cover_every_element_once(shards: int) -> None:
    tensors = [torch.randn(5, 3), torch.randn(1), torch.randn(2, 2, 2), torch.randn(11)]
    layout = FlatLayout.for_tensors(tensors, shards)
    assert layout.padded_numel % shards == 0
    assert 0 <= layout.padded_numel - layout.total_numel < shards  # padding below n elements
    flat = layout.flatten(tensors, torch.float64, torch.device("cpu"))
    assert torch.equal(flat[layout.total_numel :], torch.zeros(layout.padded_numel - 35))
    seen = [torch.zeros(t.numel(), dtype=torch.int64) for t in tensors]
    for rank in range(shards):
        shard = layout.shard(flat, rank)
        for piece in layout.pieces(rank):
            span = slice(piece.param_start, piece.param_start + piece.numel)
            seen[piece.param_index][span] += 1
            expected = tensors[piece.param_index].reshape(-1)[span].double()
            assert torch.equal(shard[piece.shard_start : piece.shard_start + piece.numel], expected)
    assert all(torch.equal(s, torch.ones_like(s)) for s in seen)
    restored = [torch.empty_like(t) for t in tensors]
    layout.unflatten_into(flat, restored)
    assert all(torch.equal(a, b) for a, b in zip(restored, tensors))


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        FlatLayout.for_tensors([torch.zeros(3)], 0)
    with pytest.raises(ValueError, match="at least one tensor"):
        FlatLayout.for_tensors([], 2)
    with pytest.raises(ValueError, match=r"shard rank 2 is outside \[0, 2\)"):
        FlatLayout.for_tensors([torch.zeros(3)], 2).pieces(2)
    with pytest.raises(ValueError, match="layout holds 1 tensors, got 2"):
        FlatLayout.for_tensors([torch.zeros(3)], 2).flatten(
            [torch.zeros(3), torch.zeros(1)], torch.float32, torch.device("cpu")
        )


def test_state_round_trips_through_safetensors_and_json(tmp_path: Path) -> None:
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2)}, 1: {}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "params": [0, 1]}],
        "master_weights": [torch.randn(5).bfloat16()],
    }
    write_state(state, tmp_path / "optim", {"sharding_size": 2})
    loaded, meta = read_state(tmp_path / "optim")
    assert meta == {"sharding_size": 2}
    assert loaded["param_groups"] == state["param_groups"]  # tuple and int keys survive
    assert torch.equal(loaded["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert loaded["state"][1] == {}
    assert loaded["master_weights"][0].dtype == torch.bfloat16
    assert not list(tmp_path.glob("*.tmp"))  # written under temporary names, then renamed
    skeleton = json.loads((tmp_path / "optim.json").read_text())
    assert skeleton["format"] == "nxd-optim/1"


def test_state_io_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cannot store object at 'state.0.bad'"):
        write_state({"state": {0: {"bad": object()}}}, tmp_path / "x", {})
    with pytest.raises(FileNotFoundError, match=r"missing\.json does not exist"):
        read_state(tmp_path / "missing")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_norm_summaries_equal_nxd_layers_norm_of_the_params(norm_type: float) -> None:
    """ZeRO-1 summarises each slice of a param by one number; get_grad_norm over the summaries
    of arbitrary slices (cut across rows) equals get_grad_norm over the whole params, for
    every attribute it reads: TP-sharded or not, a uniform replica count, per-row replica
    counts (fused QKV) and a ``shared`` tied copy (left out). fp32, summed in another order:
    rtol 1e-6."""
    from nxd_layers import get_grad_norm
    from nxd_optim._zero1_norm import GradSpan, _summaries, global_grad_norm

    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(6, 5), torch.zeros(7), torch.zeros(4, 3), torch.zeros(9), torch.zeros(5)]
    for param in params:
        param.grad = torch.randn(param.shape, generator=gen)
    params[0].tensor_model_parallel = True
    params[1].tensor_parallel_replicas = 2
    params[2].tensor_model_parallel = True
    params[2].tensor_parallel_replicas = torch.tensor([1.0, 2.0, 4.0, 2.0])  # per row
    params[3].shared = True
    params[4].unrelated = {"not": "seen by get_grad_norm"}  # does not keep its slices apart
    expected = get_grad_norm(params, norm_type)
    spans = []
    for param, cuts in zip(params, ([0, 7, 19, 30], [0, 7], [0, 4, 5, 12], [0, 9], [0, 2, 5])):
        flat = param.grad.reshape(-1)
        for start, stop in itertools.pairwise(cuts):
            spans.append(GradSpan(flat[start:stop], param, start))
    norm = global_grad_norm(
        spans,
        norm_type,
        tensor_parallel_group=None,
        pipeline_parallel_group=None,
        data_parallel_group=None,
    )
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    # 10 slices: those of one param combine (4 kinds of attributes); the 3 slices of the param
    # with per-row counts stay apart
    assert len(_summaries(spans, norm_type)) == 7
    without_shared = get_grad_norm([p for p in params if p is not params[3]], norm_type)
    torch.testing.assert_close(norm, without_shared, rtol=1e-6, atol=0)
