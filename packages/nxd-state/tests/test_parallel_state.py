"""The groups actually built on 4 and 8 gloo ranks, the NxD getters, and their errors."""

import pytest
import torch
import torch.distributed as dist

import nxd_state as ps
from nxd_state import ParallelLayout
from nxd_state.testing import run_distributed


def report_groups(tp: int, pp: int) -> dict:
    """Everything a rank can say about its place, read through the NxD getters."""
    state = ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    # Communicate in each group: the sum of global ranks proves who is really in it.
    sums = {}
    for name, group in (
        ("tp", ps.get_tensor_model_parallel_group()),
        ("dp", ps.get_data_parallel_group()),
        ("pp", ps.get_pipeline_model_parallel_group()),
        ("mp", ps.get_model_parallel_group()),
    ):
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=group)
        sums[name] = value.item()
    report = {
        "tp_ranks": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "dp_ranks": dist.get_process_group_ranks(ps.get_data_parallel_group()),
        "pp_ranks": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "sizes": (
            ps.get_tensor_model_parallel_size(),
            ps.get_pipeline_model_parallel_size(),
            ps.get_data_parallel_size(),
        ),
        "ranks": (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank(),
        ),
        "as_list": (
            ps.get_tensor_model_parallel_group(as_list=True),
            ps.get_data_parallel_group(as_list=True),
            ps.get_pipeline_model_parallel_group(as_list=True),
        ),
        "src": ps.get_tensor_model_parallel_src_rank(),
        "next": ps.get_pipeline_model_parallel_next_rank(),
        "prev": ps.get_pipeline_model_parallel_prev_rank(),
        "first_last": (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
        "sums": sums,
        "same_object": state is ps.get_parallel_state(),
    }
    ps.destroy_model_parallel()
    report["initialized_after_destroy"] = ps.model_parallel_is_initialized()
    return report


@pytest.mark.parametrize(
    ("world", "tp", "pp"), [(4, 2, 1), (4, 1, 2), (4, 2, 2), (8, 2, 2), (8, 4, 1), (8, 2, 4)]
)
def test_built_groups_match_layout(world: int, tp: int, pp: int) -> None:
    layout = ParallelLayout(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    reports = run_distributed(report_groups, world, tp, pp)
    for rank, report in enumerate(reports):
        tp_group = next(g for g in layout.tensor_parallel_groups() if rank in g)
        dp_group = next(g for g in layout.data_parallel_groups() if rank in g)
        pp_group = next(g for g in layout.pipeline_parallel_groups() if rank in g)
        mp_group = next(g for g in layout.model_parallel_groups() if rank in g)
        assert report["tp_ranks"] == tp_group
        assert report["dp_ranks"] == dp_group
        assert report["pp_ranks"] == pp_group
        assert report["sums"] == {
            "tp": sum(tp_group),
            "dp": sum(dp_group),
            "pp": sum(pp_group),
            "mp": sum(mp_group),
        }
        coords = layout.coordinates(rank)
        assert report["sizes"] == (tp, pp, layout.data_parallel_size)
        assert report["ranks"] == (coords.tp, coords.pp, coords.dp)
        assert report["as_list"] == (
            layout.tensor_parallel_groups(),
            layout.data_parallel_groups(),
            layout.pipeline_parallel_groups(),
        )
        assert report["src"] == tp_group[0]
        stage = pp_group.index(rank)
        assert report["next"] == pp_group[(stage + 1) % pp]
        assert report["prev"] == pp_group[(stage - 1) % pp]
        assert report["first_last"] == (stage == 0, stage == pp - 1)
        assert report["same_object"]
        assert not report["initialized_after_destroy"]


def initialize_and_capture(tp: int, pp: int) -> str:
    try:
        ps.initialize_model_parallel(tp, pp)
    except ValueError as error:
        return str(error)
    return "no error"


def test_degree_not_dividing_world_fails_on_every_rank() -> None:
    messages = run_distributed(initialize_and_capture, 4, 3, 1)
    assert all("tensor_parallel_size(3)" in m and "world_size(4)" in m for m in messages)


def test_non_positive_degree_fails_on_every_rank() -> None:
    messages = run_distributed(initialize_and_capture, 2, 1, 0)
    assert all("pipeline_parallel_size must be a positive integer, got 0" in m for m in messages)


def reinitialize(first: tuple[int, int], second: tuple[int, int]) -> str:
    state = ps.initialize_model_parallel(*first)
    try:
        again = ps.initialize_model_parallel(*second)
    except RuntimeError as error:
        return str(error)
    return "same state" if again is state else "new state"


def test_reinitialize_with_same_sizes_returns_current_state() -> None:
    assert run_distributed(reinitialize, 2, (2, 1), (2, 1)) == ["same state"] * 2


def test_reinitialize_with_other_sizes_names_both() -> None:
    messages = run_distributed(reinitialize, 2, (2, 1), (1, 2))
    for message in messages:
        assert "already initialized with tensor_model_parallel_size=2" in message
        assert (
            "re-initialize with tensor_model_parallel_size=1, pipeline_model_parallel_size=2"
            in message
        )


@pytest.mark.parametrize(
    "getter",
    [
        ps.get_tensor_model_parallel_size,
        ps.get_tensor_model_parallel_rank,
        ps.get_data_parallel_group,
        ps.get_pipeline_model_parallel_next_rank,
        ps.get_tensor_model_parallel_src_rank,
    ],
)
def test_getter_before_initialization_says_what_to_call(getter) -> None:
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(
        RuntimeError, match=r"not initialized: call nxd_state.initialize_model_parallel"
    ):
        getter()


def test_initialize_without_process_group_says_what_to_call() -> None:
    assert not dist.is_initialized()
    with pytest.raises(
        RuntimeError, match=r"torch.distributed is not initialized: call nxd_state.init_distributed"
    ):
        ps.initialize_model_parallel(1, 1)
