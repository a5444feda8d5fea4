"""Expert-parallel groups carved out of data parallelism: the layout written out by hand at
world 8 for several (tp, pp, cp, ep), bad EP degrees refused naming the values, and the groups
actually built on 8 gloo ranks, read through NxD's getters."""

import pytest
import torch
import torch.distributed as dist

import nxd_state as ps
from nxd_state import ParallelLayout
from nxd_state.testing import run_distributed

# (tp, pp, cp, ep) at world 8 -> (EP groups, expert DP groups), written out by hand from
# rank = ((pp * DP + dp) * CP + cp) * TP + tp and dp = dp_exp * EP + ep_rank: an EP group is
# EP consecutive DP ranks, an expert DP group the ranks with the same (pp, tp, ep_rank).
CASES = {
    (1, 1, 1, 2): ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    (1, 1, 1, 4): ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (1, 1, 1, 8): ([list(range(8))], [[r] for r in range(8)]),
    (2, 1, 1, 2): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (2, 2, 1, 2): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[r] for r in range(8)]),
    (1, 2, 1, 4): ([[0, 1, 2, 3], [4, 5, 6, 7]], [[r] for r in range(8)]),
    (1, 1, 2, 2): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 1, 4, 5], [2, 3, 6, 7]]),
    (2, 1, 2, 2): ([[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]]),
}


def layout_of(tp: int, pp: int, cp: int, ep: int) -> ParallelLayout:
    return ParallelLayout(
        world_size=8,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )


@pytest.mark.parametrize(("tp", "pp", "cp", "ep"), list(CASES))
def test_expert_groups_written_out(tp: int, pp: int, cp: int, ep: int) -> None:
    layout = layout_of(tp, pp, cp, ep)
    ep_groups, edp_groups = CASES[(tp, pp, cp, ep)]
    assert layout.expert_model_parallel_groups() == ep_groups
    assert layout.expert_data_parallel_groups() == edp_groups
    assert layout.expert_data_parallel_size == layout.data_parallel_size // ep * cp
    for rank in range(8):
        ep_group = next(g for g in ep_groups if rank in g)
        edp_group = next(g for g in edp_groups if rank in g)
        assert layout.expert_model_parallel_rank(rank) == ep_group.index(rank)
        assert layout.expert_data_parallel_rank(rank) == edp_group.index(rank)
        # Every EP group lies inside one DP group (EP is carved out of DP).
        assert any(set(ep_group) <= set(g) for g in layout.data_parallel_groups())


def test_ep_one_keeps_singletons_and_dp_cp() -> None:
    layout = layout_of(2, 1, 2, 1)
    assert layout.expert_model_parallel_groups() == [[r] for r in range(8)]
    assert layout.expert_data_parallel_groups() == layout.data_context_parallel_groups()


@pytest.mark.parametrize(
    ("tp", "pp", "cp", "ep", "message"),
    [
        (2, 1, 1, 8, r"expert_model_parallel_size\(8\) does not divide data_parallel_size\(4\)"),
        (1, 1, 1, 3, r"expert_model_parallel_size\(3\) does not divide data_parallel_size\(8\)"),
        (2, 2, 2, 2, r"expert_model_parallel_size\(2\) does not divide data_parallel_size\(1\)"),
    ],
)
def test_ep_not_dividing_dp_names_both(tp: int, pp: int, cp: int, ep: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout_of(tp, pp, cp, ep)


def report_ep(tp: int, pp: int, cp: int, ep: int) -> dict:
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
    )
    sums = {}
    for name, group in (
        ("ep", ps.get_expert_model_parallel_group()),
        ("edp", ps.get_expert_data_parallel_group()),
    ):
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=group)
        sums[name] = value.item()
    report = {
        "ep": (
            ps.get_expert_model_parallel_size(),
            ps.get_expert_model_parallel_rank(),
            dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
        ),
        "edp": (
            ps.get_expert_data_parallel_size(),
            ps.get_expert_data_parallel_rank(),
            dist.get_process_group_ranks(ps.get_expert_data_parallel_group()),
        ),
        "lists": (
            ps.get_expert_model_parallel_group(as_list=True),
            ps.get_expert_model_parallel_replica_groups(),
            ps.get_expert_data_parallel_group(as_list=True),
            ps.get_expert_data_parallel_replica_groups(),
        ),
        "sums": sums,
    }
    ps.destroy_model_parallel()
    return report


@pytest.mark.parametrize(("tp", "pp", "cp", "ep"), [(1, 1, 1, 4), (2, 1, 2, 2)])
def test_built_expert_groups_match_layout(tp: int, pp: int, cp: int, ep: int) -> None:
    ep_groups, edp_groups = CASES[(tp, pp, cp, ep)]
    for rank, report in enumerate(run_distributed(report_ep, 8, tp, pp, cp, ep)):
        ep_group = next(g for g in ep_groups if rank in g)
        edp_group = next(g for g in edp_groups if rank in g)
        assert report["ep"] == (ep, ep_group.index(rank), ep_group)
        assert report["edp"] == (len(edp_group), edp_group.index(rank), edp_group)
        assert report["lists"] == (ep_groups, ep_groups, edp_groups, edp_groups)
        # The all-reduced sums prove who is really in each built group.
        assert report["sums"] == {"ep": float(sum(ep_group)), "edp": float(sum(edp_group))}
