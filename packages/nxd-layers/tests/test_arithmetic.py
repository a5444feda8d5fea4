"""Logic without communication: divisibility, head padding, KV multipliers, shard layouts,
NxD's ``parallel_layers.utils`` helpers and NxD's GQA rank order."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import nxd_layers
from nxd_layers import (
    EmbeddingUtility,
    cast_all,
    divide,
    get_kv_size_multiplier,
    get_number_of_extra_heads,
    get_padding_length,
    gqa_kv_replica_rows,
    is_torch_version_greater_than_2,
    merge_shards,
    neuronx_gqa_rank_map,
    shard_for_rank,
    split_tensor_along_last_dim,
    split_tensor_along_second_dim,
)


def test_version_matches_distribution_metadata() -> None:
    assert nxd_layers.__version__ == importlib.metadata.version("nxd-layers")


def test_divide_is_exact_or_names_the_values() -> None:
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match=r"numerator\(10\) is not divisible by 4"):
        divide(10, 4)
    with pytest.raises(ValueError, match="denominator must be positive, got 0"):
        divide(10, 0)


@pytest.mark.parametrize(
    ("heads", "tp", "extra"), [(32, 8, 0), (25, 32, 7), (3, 2, 1), (3, 4, 1), (40, 32, 24)]
)
def test_number_of_extra_heads_pads_to_a_multiple(heads: int, tp: int, extra: int) -> None:
    assert get_number_of_extra_heads(heads, tp) == extra
    assert (heads + extra) % tp == 0


@pytest.mark.parametrize(
    ("kv_heads", "tp", "multiplier"),
    [(8, 8, 1), (8, 4, 1), (2, 4, 2), (2, 8, 4), (3, 4, 4), (6, 4, 2)],
)
def test_kv_size_multiplier_is_the_smallest_valid(kv_heads: int, tp: int, multiplier: int) -> None:
    assert get_kv_size_multiplier(kv_heads, tp) == multiplier
    assert (kv_heads * multiplier) % tp == 0
    assert all((kv_heads * m) % tp for m in range(1, multiplier))


def test_multiplier_and_extra_heads_reject_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match=r"num_key_value_heads\(0\)"):
        get_kv_size_multiplier(0, 4)
    with pytest.raises(ValueError, match=r"tp_degree\(0\)"):
        get_number_of_extra_heads(4, 0)


@pytest.mark.parametrize(("dim", "stride"), [(0, 1), (0, 2), (1, 1), (1, 3)])
def test_shards_follow_the_stride_layout_and_merge_back(dim: int, stride: int) -> None:
    full = torch.arange(12 * 24).reshape(12, 24)
    n = 2
    shards = [shard_for_rank(full, dim, r, n, stride) for r in range(n)]
    chunks = full.chunk(n * stride, dim=dim)
    for r, shard in enumerate(shards):  # rank r: chunks r, r + n, r + 2n, ...
        torch.testing.assert_close(shard, torch.cat(chunks[r::n], dim=dim), rtol=0, atol=0)
    torch.testing.assert_close(merge_shards(shards, dim, stride), full, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"size of dim 0\(12\) is not divisible by 5"):
        shard_for_rank(full, 0, 0, 5)


def test_nxd_split_and_padding_helpers() -> None:
    t = torch.arange(2 * 6 * 4).reshape(2, 6, 4)
    last = split_tensor_along_last_dim(t, 2)
    assert [c.shape for c in last] == [(2, 6, 2)] * 2
    assert not last[0].is_contiguous()  # views, as torch.split gives
    second = split_tensor_along_second_dim(t, 3, contiguous_split_chunks=True)
    assert all(c.is_contiguous() for c in second)
    torch.testing.assert_close(torch.cat(second, dim=1), t, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"numerator\(4\) is not divisible by 3"):
        split_tensor_along_last_dim(t, 3)
    assert [get_padding_length(n, 4) for n in (8, 9, 10, 11)] == [0, 3, 2, 1]
    assert EmbeddingUtility.range_from_global_vocab_size(64, 2, 4) == (32, 48)
    assert EmbeddingUtility.range_from_per_partition_vocab_size(16, 3, 4) == (48, 64)
    assert is_torch_version_greater_than_2()  # torch >= 2.9 is required


def test_cast_all_casts_only_the_source_dtype_in_nests() -> None:
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    state = {
        "w": torch.ones(2),
        "i": torch.ones(2, dtype=torch.int64),
        "n": [pair(torch.ones(1), 3)],
    }
    cast = cast_all(state)
    assert cast["w"].dtype == torch.bfloat16
    assert cast["i"].dtype == torch.int64
    assert isinstance(cast["n"][0], pair)
    assert cast["n"][0].a.dtype == torch.bfloat16
    assert cast["n"][0].b == 3


def test_neuronx_gqa_rank_map() -> None:
    # One KV head per rank: NxD's rank r holds KV head r % n_kv; here rank s holds s // m.
    for heads, kv, tp in ((8, 2, 8), (16, 4, 8), (32, 8, 32)):
        m = tp // kv
        mapping = neuronx_gqa_rank_map(heads, kv, tp, m)
        assert sorted(mapping) == list(range(tp))
        assert [s // m for s in mapping] == [r % kv for r in range(tp)]
    assert neuronx_gqa_rank_map(8, 2, 8, 4) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert neuronx_gqa_rank_map(8, 8, 4, 1) == [0, 1, 2, 3]  # no replication: same layout
    with pytest.raises(ValueError, match=r"must equal tensor_parallel_size\(4\)"):
        neuronx_gqa_rank_map(8, 4, 4, 2)
    with pytest.raises(ValueError, match=r"num_heads\(6\) must be divisible"):
        neuronx_gqa_rank_map(6, 2, 4, 2)


def test_gqa_kv_replica_rows() -> None:
    # 2 KV heads of 3 rows, each repeated twice head by head: [k0, k0, k1, k1].
    assert gqa_kv_replica_rows(2, 3, 2) == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert gqa_kv_replica_rows(3, 2, 1) == list(range(6))  # no replication
    k = torch.randn(8, 5)  # 4 heads of 2 rows, multiplier 3: the rows a layer would hold
    replicated = k[gqa_kv_replica_rows(4, 2, 3)]
    heads = replicated.reshape(4, 3, 2, 5)
    for copy in range(3):
        assert torch.equal(heads[:, copy].reshape(8, 5), k)
    with pytest.raises(ValueError, match=r"kv_size_multiplier\(0\) must be positive"):
        gqa_kv_replica_rows(2, 3, 0)
