"""NxD's wider parallel_state surface on 4 and 8 gloo ranks: replica groups, the CP and EP
getters at degree 1, initialize_model_parallel's NxD arguments, and the refusal of bad
CP/EP degrees."""

import pytest
import torch
import torch.distributed as dist

import nxd_state as ps
from nxd_state import ParallelLayout
from nxd_state.testing import run_distributed


def member_sum(group: dist.ProcessGroup) -> float:
    """Sum of the global ranks in ``group``, by an all-reduce: proves who is really in it."""
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=group)
    return value.item()


def report_nxd_surface(tp: int, pp: int) -> dict:
    ps.initialize_model_parallel(tp, pp, 1, skip_collective_init=True, lnc_size=2)
    report = {
        "replica": (
            ps.get_tensor_model_parallel_replica_groups(),
            ps.get_data_parallel_replica_groups(),
            ps.get_pipeline_model_parallel_replica_groups(),
        ),
        "as_list_is_replica": (
            ps.get_tensor_model_parallel_group(as_list=True)
            == ps.get_tensor_model_parallel_replica_groups()
            and ps.get_data_parallel_group(as_list=True) == ps.get_data_parallel_replica_groups()
            and ps.get_pipeline_model_parallel_group(as_list=True)
            == ps.get_pipeline_model_parallel_replica_groups()
        ),
        "cp": (
            ps.get_context_model_parallel_size(),
            ps.get_context_model_parallel_rank(),
            dist.get_process_group_ranks(ps.get_context_model_parallel_group()),
            member_sum(ps.get_context_model_parallel_group()),
            ps.get_context_model_parallel_group(as_list=True),
            ps.get_context_model_parallel_replica_groups(),
        ),
        "ep": (
            ps.get_expert_model_parallel_size(),
            ps.get_expert_model_parallel_rank(),
            dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
            member_sum(ps.get_expert_model_parallel_group()),
            ps.get_expert_model_parallel_group(as_list=True),
        ),
        "expert_dp": (
            ps.get_expert_data_parallel_size(),
            ps.get_expert_data_parallel_rank(),
            dist.get_process_group_ranks(ps.get_expert_data_parallel_group()),
            ps.get_expert_data_parallel_replica_groups(),
        ),
        "dp": (
            ps.get_data_parallel_size(),
            ps.get_data_parallel_rank(),
            dist.get_process_group_ranks(ps.get_data_parallel_group()),
        ),
        "zero1": ps.get_zero1_sharding_groups(),
    }
    ps.destroy_model_parallel()
    return report


@pytest.mark.parametrize(("world", "tp", "pp"), [(4, 2, 1), (4, 1, 2), (8, 2, 2), (8, 4, 1)])
def test_replica_groups_and_degree_one_cp_ep(world: int, tp: int, pp: int) -> None:
    layout = ParallelLayout(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    singletons = [[r] for r in range(world)]
    for rank, report in enumerate(run_distributed(report_nxd_surface, world, tp, pp)):
        assert report["replica"] == (
            layout.tensor_parallel_groups(),
            layout.data_parallel_groups(),
            layout.pipeline_parallel_groups(),
        )
        assert report["as_list_is_replica"]
        # CP and EP of degree 1: rank 0 of a group holding this rank alone.
        assert report["cp"] == (1, 0, [rank], float(rank), singletons, singletons)
        assert report["ep"] == (1, 0, [rank], float(rank), singletons)
        # Expert data parallelism is data parallelism when EP = 1.
        dp_size, dp_rank, dp_ranks = report["dp"]
        assert report["expert_dp"] == (dp_size, dp_rank, dp_ranks, layout.data_parallel_groups())
        assert report["zero1"] == layout.data_parallel_groups()


def initialize_and_capture(**kwargs: object) -> tuple[str, str, bool]:
    try:
        ps.initialize_model_parallel(**kwargs)
    except (NotImplementedError, ValueError) as error:
        return type(error).__name__, str(error), ps.model_parallel_is_initialized()
    return "no error", "", ps.model_parallel_is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "kind", "message"),
    [
        (
            {"tensor_model_parallel_size": 2, "context_parallel_size": 4},
            "ValueError",
            "tensor_parallel_size(2) x pipeline_parallel_size(1) x context_parallel_size(4) = 8 "
            "does not divide world_size(2)",
        ),
        (
            {"expert_model_parallel_size": 4},
            "ValueError",
            "expert_model_parallel_size(4) does not divide data_parallel_size(2)",
        ),
        ({"lnc_size": 0}, "ValueError", "lnc_size must be a positive integer, got 0"),
        (
            {"skip_collective_init": "yes"},
            "ValueError",
            "skip_collective_init must be a bool, got 'yes'",
        ),
    ],
)
def test_unsupported_arguments_fail_on_every_rank_before_any_group(
    kwargs: dict, kind: str, message: str
) -> None:
    for result in run_distributed(initialize_and_capture, 2, **kwargs):
        assert result[0] == kind
        assert message in result[1]
        assert result[2] is False  # nothing was built


def clamped_sizes() -> tuple[int, int, int]:
    ps.initialize_model_parallel(tensor_model_parallel_size=8)
    return (
        ps.get_tensor_model_parallel_size(),
        ps.get_data_parallel_size(),
        len(ps.get_tensor_model_parallel_replica_groups()),
    )


def test_degree_above_world_is_clamped_like_nxd() -> None:
    assert run_distributed(clamped_sizes, 4) == [(4, 1, 1)] * 4
