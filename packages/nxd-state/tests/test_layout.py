"""Rank meshes checked against hand-computed layouts: pure arithmetic, no processes."""

import itertools

import pytest

from nxd_state import ParallelLayout, RankCoordinates

# (world, tp, pp) -> hand-written TP, DP and PP groups for the row-major [PP, DP, TP] layout.
HAND_COMPUTED = {
    (1, 1, 1): ([[0]], [[0]], [[0]]),
    (4, 4, 1): ([[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0], [1], [2], [3]]),
    (4, 1, 4): ([[0], [1], [2], [3]], [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    (4, 1, 1): ([[0], [1], [2], [3]], [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (4, 2, 1): ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0], [1], [2], [3]]),
    (4, 2, 2): ([[0, 1], [2, 3]], [[0], [1], [2], [3]], [[0, 2], [1, 3]]),
    (8, 2, 2): (
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    (8, 2, 1): (
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0, 2, 4, 6], [1, 3, 5, 7]],
        [[0], [1], [2], [3], [4], [5], [6], [7]],
    ),
    (8, 1, 2): (
        [[0], [1], [2], [3], [4], [5], [6], [7]],
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    (8, 4, 2): (
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[0], [1], [2], [3], [4], [5], [6], [7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    (8, 2, 4): (
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0], [1], [2], [3], [4], [5], [6], [7]],
        [[0, 2, 4, 6], [1, 3, 5, 7]],
    ),
    (16, 4, 2): (
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    ),
    (12, 2, 3): (
        [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]],
        [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]],
        [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]],
    ),
}


@pytest.mark.parametrize(("world", "tp", "pp"), sorted(HAND_COMPUTED))
def test_groups_match_hand_computed_layout(world: int, tp: int, pp: int) -> None:
    layout = ParallelLayout(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    tp_groups, dp_groups, pp_groups = HAND_COMPUTED[(world, tp, pp)]
    assert layout.tensor_parallel_groups() == tp_groups
    assert layout.data_parallel_groups() == dp_groups
    assert layout.pipeline_parallel_groups() == pp_groups
    assert layout.data_parallel_size == world // (tp * pp)


def test_coordinates_of_one_rank_by_hand() -> None:
    layout = ParallelLayout(world_size=16, tensor_parallel_size=4, pipeline_parallel_size=2)
    # rank 13 = pp 1 * (2*4) + dp 1 * 4 + tp 1
    assert layout.coordinates(13) == RankCoordinates(pp=1, dp=1, tp=1)
    assert layout.rank_of(pp=1, dp=1, tp=1) == 13


@pytest.mark.parametrize(
    ("world", "tp", "pp"),
    [
        (w, t, p)
        for w in (1, 2, 4, 6, 8, 12, 16, 32)
        for t in (1, 2, 4, 8)
        for p in (1, 2, 3, 4)
        if w % (t * p) == 0
    ],
)
def test_every_family_partitions_the_world(world: int, tp: int, pp: int) -> None:
    layout = ParallelLayout(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    families = {
        "tp": (layout.tensor_parallel_groups(), tp),
        "dp": (layout.data_parallel_groups(), layout.data_parallel_size),
        "pp": (layout.pipeline_parallel_groups(), pp),
        "mp": (layout.model_parallel_groups(), tp * pp),
    }
    for name, (groups, size) in families.items():
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(world)), name
        assert all(len(group) == size for group in groups), name
    for rank in range(world):
        coords = layout.coordinates(rank)
        assert layout.rank_of(pp=coords.pp, dp=coords.dp, tp=coords.tp) == rank
        # TP innermost: TP neighbours are adjacent global ranks.
        tp_group = next(g for g in layout.tensor_parallel_groups() if rank in g)
        assert tp_group == list(range(tp_group[0], tp_group[0] + tp))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 8, "tensor_parallel_size": 3},
            r"tensor_parallel_size\(3\).*does not divide world_size\(8\)",
        ),
        (
            {"world_size": 8, "tensor_parallel_size": 2, "pipeline_parallel_size": 3},
            r"= 6 does not divide world_size\(8\)",
        ),
        (
            {"world_size": 4, "tensor_parallel_size": 0},
            r"tensor_parallel_size must be a positive integer, got 0",
        ),
        (
            {"world_size": 4, "pipeline_parallel_size": -2},
            r"pipeline_parallel_size must be a positive integer, got -2",
        ),
        ({"world_size": 0}, r"world_size must be a positive integer, got 0"),
        (
            {"world_size": 4, "tensor_parallel_size": 2.0},
            r"tensor_parallel_size must be a positive integer, got 2.0",
        ),
        ({"world_size": 4, "tensor_parallel_size": True}, r"got True"),
    ],
)
def test_bad_degrees_name_the_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


def test_out_of_range_rank_and_coordinates() -> None:
    layout = ParallelLayout(world_size=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"rank 4 is outside \[0, world_size\(4\)\)"):
        layout.coordinates(4)
    with pytest.raises(ValueError, match=r"tp coordinate 2 is outside \[0, 2\)"):
        layout.rank_of(pp=0, dp=0, tp=2)


# CP and EP at degree 1 (EP above 1: tests/test_expert_parallel_layout.py) --------------------
def test_expert_degree_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"expert_model_parallel_size must be a positive integer"):
        ParallelLayout(world_size=4, expert_model_parallel_size=0)


def test_context_and_expert_groups_at_degree_one() -> None:
    layout = ParallelLayout(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.context_parallel_groups() == [[r] for r in range(8)]
    assert layout.expert_model_parallel_groups() == [[r] for r in range(8)]
    # NxD's expert view [PP, DP_exp, EP, TP] with EP = 1 is the [PP, DP, TP] view.
    assert layout.expert_data_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


# KV-shared groups ----------------------------------------------------------------------------
# (world, tp, kv_shared_group_size) -> (interleaved, sequential), written out by hand.
KV_HAND_COMPUTED = {
    (4, 4, 2): ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
    (8, 4, 2): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (8, 8, 4): ([[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (8, 8, 2): (
        [[0, 4], [1, 5], [2, 6], [3, 7]],
        [[0, 1], [2, 3], [4, 5], [6, 7]],
    ),
    (8, 4, 4): ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (4, 2, 1): ([[0], [1], [2], [3]], [[0], [1], [2], [3]]),
}


@pytest.mark.parametrize(("world", "tp", "size"), sorted(KV_HAND_COMPUTED))
def test_kv_shared_groups_match_hand_computed(world: int, tp: int, size: int) -> None:
    layout = ParallelLayout(world_size=world, tensor_parallel_size=tp)
    interleaved, sequential = KV_HAND_COMPUTED[(world, tp, size)]
    assert layout.kv_shared_groups(size) == interleaved
    assert layout.kv_shared_groups(size, sequential_ranks_in_group=True) == sequential


def ranks_by_held_heads(head_order: list[int], tp: int) -> list[list[int]]:
    """Split a replicated head list over ``tp`` ranks; group ranks that hold the same heads."""
    per_rank = len(head_order) // tp
    held: dict[tuple[int, ...], list[int]] = {}
    for rank in range(tp):
        held.setdefault(tuple(head_order[rank * per_rank : (rank + 1) * per_rank]), []).append(rank)
    return sorted(held.values())


@pytest.mark.parametrize(
    ("tp", "kv_heads", "multiplier"),
    [(4, 2, 2), (8, 2, 4), (8, 1, 8), (8, 4, 2), (8, 4, 4), (8, 2, 8), (16, 8, 4)],
)
def test_interleaved_kv_groups_are_the_ranks_holding_the_same_heads(
    tp: int, kv_heads: int, multiplier: int
) -> None:
    """NxD replicates K/V block-wise ([k_0 .. k_{h-1}] m times) before the column split."""
    blockwise = list(range(kv_heads)) * multiplier
    layout = ParallelLayout(world_size=tp, tensor_parallel_size=tp)
    assert sorted(layout.kv_shared_groups(multiplier)) == ranks_by_held_heads(blockwise, tp)


@pytest.mark.parametrize(("tp", "kv_heads"), [(4, 2), (8, 2), (8, 4), (8, 1)])
def test_sequential_kv_groups_are_the_ranks_holding_the_same_head(tp: int, kv_heads: int) -> None:
    """Heads replicated one by one ([k_0, k_0, .., k_1, k_1, ..]), one KV head per rank."""
    multiplier = tp // kv_heads
    one_by_one = [head for head in range(kv_heads) for _ in range(multiplier)]
    layout = ParallelLayout(world_size=tp, tensor_parallel_size=tp)
    groups = layout.kv_shared_groups(multiplier, sequential_ranks_in_group=True)
    assert sorted(groups) == ranks_by_held_heads(one_by_one, tp)


def test_kv_shared_group_size_must_divide_tp() -> None:
    layout = ParallelLayout(world_size=8, tensor_parallel_size=4)
    with pytest.raises(
        ValueError, match=r"kv_shared_group_size\(3\) does not divide tensor_parallel_size\(4\)"
    ):
        layout.kv_shared_groups(3)
    with pytest.raises(ValueError, match=r"kv_shared_group_size must be a positive integer"):
        layout.kv_shared_groups(0)
