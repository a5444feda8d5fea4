"""Logic without communication: divisibility, head padding, KV multipliers, shard layouts."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import nxd_layers
from nxd_layers import (
    divide,
    get_kv_size_multiplier,
    get_number_of_extra_heads,
    merge_shards,
    shard_for_rank,
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
