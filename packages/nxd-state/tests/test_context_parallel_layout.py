"""Context-parallel groups: the ``[PP, DP, CP, TP]`` layout written out by hand at world 4 and
8, and the groups actually built on gloo ranks, read through NxD's getters."""

import pytest
import torch
import torch.distributed as dist

import nxd_state as ps
from nxd_state import ParallelLayout, RankCoordinates
from nxd_state.testing import run_distributed

# (world, tp, pp, cp) -> expected groups, written out by hand from
# rank = ((pp * DP + dp) * CP + cp) * TP + tp.
CASES = {
    (4, 1, 1, 2): {
        "tp": [[0], [1], [2], [3]],
        "cp": [[0, 1], [2, 3]],
        "dp": [[0, 2], [1, 3]],
        "dp_cp": [[0, 1, 2, 3]],
        "pp": [[0], [1], [2], [3]],
        "pairs": [[0, 1], [1, 0], [2, 3], [3, 2]],
    },
    (4, 1, 1, 4): {
        "tp": [[0], [1], [2], [3]],
        "cp": [[0, 1, 2, 3]],
        "dp": [[0], [1], [2], [3]],
        "dp_cp": [[0, 1, 2, 3]],
        "pp": [[0], [1], [2], [3]],
        "pairs": [[0, 1], [1, 2], [2, 3], [3, 0]],
    },
    (4, 2, 1, 2): {
        "tp": [[0, 1], [2, 3]],
        "cp": [[0, 2], [1, 3]],
        "dp": [[0], [1], [2], [3]],
        "dp_cp": [[0, 2], [1, 3]],
        "pp": [[0], [1], [2], [3]],
        "pairs": [[0, 2], [2, 0], [1, 3], [3, 1]],
    },
    (8, 2, 1, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "pairs": [[0, 2], [2, 0], [1, 3], [3, 1], [4, 6], [6, 4], [5, 7], [7, 5]],
    },
    (8, 2, 2, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pairs": [[0, 2], [2, 0], [1, 3], [3, 1], [4, 6], [6, 4], [5, 7], [7, 5]],
    },
    (8, 1, 1, 4): {
        "tp": [[r] for r in range(8)],
        "cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_cp": [list(range(8))],
        "pp": [[r] for r in range(8)],
        "pairs": [[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [7, 4]],
    },
}


@pytest.mark.parametrize(("world", "tp", "pp", "cp"), list(CASES))
def test_layout_groups_written_out(world: int, tp: int, pp: int, cp: int) -> None:
    layout = ParallelLayout(
        world_size=world,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        context_parallel_size=cp,
    )
    expected = CASES[(world, tp, pp, cp)]
    assert layout.tensor_parallel_groups() == expected["tp"]
    assert layout.context_parallel_groups() == expected["cp"]
    assert layout.data_parallel_groups() == expected["dp"]
    assert layout.data_context_parallel_groups() == expected["dp_cp"]
    assert layout.pipeline_parallel_groups() == expected["pp"]
    assert layout.context_parallel_src_tgt_pairs() == expected["pairs"]
    assert layout.expert_data_parallel_groups() == expected["dp_cp"]
    assert layout.data_parallel_size * cp * tp * pp == world
    for rank in range(world):  # coordinates and rank_of are inverse
        c = layout.coordinates(rank)
        assert layout.rank_of(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp) == rank
        assert expected["cp"][[rank in g for g in expected["cp"]].index(True)][c.cp] == rank


def test_cp_one_is_the_pp_dp_tp_layout() -> None:
    """CP = 1 changes nothing: same groups, same coordinates, no ring pairs."""
    layout = ParallelLayout(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.data_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_context_parallel_groups() == layout.data_parallel_groups()
    assert layout.context_parallel_groups() == [[r] for r in range(8)]
    assert layout.context_parallel_src_tgt_pairs() == []
    assert layout.coordinates(5) == RankCoordinates(1, 0, 1)  # (pp, dp, tp), cp = 0


def test_cp_not_dividing_world_names_every_degree() -> None:
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size\(2\) x pipeline_parallel_size\(1\) x "
        r"context_parallel_size\(3\) = 6 does not divide world_size\(8\)",
    ):
        ParallelLayout(world_size=8, tensor_parallel_size=2, context_parallel_size=3)
    with pytest.raises(ValueError, match=r"context_parallel_size must be a positive integer"):
        ParallelLayout(world_size=8, context_parallel_size=0)


def report_cp(tp: int, pp: int, cp: int) -> dict:
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    sums = {}
    for name, group in (
        ("cp", ps.get_context_model_parallel_group()),
        ("dp", ps.get_data_parallel_group()),
        ("dp_cp", ps.get_data_parallel_group(with_context_parallel=True)),
    ):
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=group)
        sums[name] = value.item()
    return {
        "cp": (
            ps.get_context_model_parallel_size(),
            ps.get_context_model_parallel_rank(),
            dist.get_process_group_ranks(ps.get_context_model_parallel_group()),
        ),
        "cp_as_list": ps.get_context_model_parallel_group(as_list=True),
        "pairs": ps.get_context_model_parallel_src_tgt_pairs(),
        "dp": (ps.get_data_parallel_size(), ps.get_data_parallel_rank()),
        "dp_cp": (
            ps.get_data_context_parallel_size(),
            dist.get_process_group_ranks(ps.get_data_context_parallel_group()),
        ),
        "zero1": ps.get_zero1_sharding_groups(),
        "expert_dp": (ps.get_expert_data_parallel_size(), ps.get_expert_data_parallel_rank()),
        "sums": sums,
    }


@pytest.mark.parametrize(("world", "tp", "pp", "cp"), [(4, 1, 1, 2), (8, 2, 1, 2)])
def test_built_cp_groups_match_layout(world: int, tp: int, pp: int, cp: int) -> None:
    expected = CASES[(world, tp, pp, cp)]
    layout = ParallelLayout(
        world_size=world,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        context_parallel_size=cp,
    )

    def mine(groups: list[list[int]], rank: int) -> list[int]:
        return next(g for g in groups if rank in g)

    for rank, report in enumerate(run_distributed(report_cp, world, tp, pp, cp)):
        cp_group = mine(expected["cp"], rank)
        assert report["cp"] == (cp, cp_group.index(rank), cp_group)
        assert report["cp_as_list"] == expected["cp"]
        assert report["pairs"] == expected["pairs"]
        dp_group = mine(expected["dp"], rank)
        assert report["dp"] == (len(dp_group), dp_group.index(rank))
        dcp_group = mine(expected["dp_cp"], rank)
        assert report["dp_cp"] == (len(dcp_group), dcp_group)
        assert report["zero1"] == expected["dp_cp"]
        assert report["expert_dp"] == (len(dcp_group), dcp_group.index(rank))
        # The all-reduced sums prove who is really in each built group.
        assert report["sums"] == {
            "cp": float(sum(cp_group)),
            "dp": float(sum(dp_group)),
            "dp_cp": float(sum(dcp_group)),
        }
        assert layout.coordinates(rank).cp == cp_group.index(rank)
