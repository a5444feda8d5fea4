"""NxD's ``parallel_state`` (and the rank-aware helpers around it) on 4 gloo ranks.

One spawn, several NxD-style scripts in sequence:

* NxD's ``context_parallel_size=2`` (with TP=2) builds CP groups its getters report;
  ``expert_model_parallel_size=4`` carves one EP group out of DP=4 (NxD's EP getters report it,
  the expert-DP group is each rank alone), and an EP that does not divide DP is refused on every
  rank with both values named, before any group exists; NxD's MoE module runs at EP=4;
* TP=4: NxD's KV-shared groups (``initialize_kv_group``: interleaved by default, sequential on
  request), their getters and ``destroy_kv_group``; then ``destroy_model_parallel``;
* TP=2 x PP=2 with NxD's keyword ``context_parallel_size=1, expert_model_parallel_size=1``: the
  ``get_*_replica_groups`` (equal to ``as_list=True``), the CP/EP getters at size 1, ``rmsg``,
  the source ranks, a tensor through ``pipeline.comm.send`` / ``recv_from``, and
  ``utils.logger.get_logger`` speaking on global rank 0 only unless ``rank0_only=False``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from nxd_state.testing import run_distributed, run_named_checks

WORLD = 4


def check_context_parallel_and_unsupported_ep() -> None:
    from neuronx_distributed.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    rank = torch.distributed.get_rank()
    # [PP, DP, CP, TP] at world 4: TP pairs {0,1}, {2,3}; CP pairs {0,2}, {1,3}.
    assert ps.get_context_model_parallel_size() == 2
    assert ps.get_context_model_parallel_rank() == rank // 2
    cp_ranks = torch.distributed.get_process_group_ranks(ps.get_context_model_parallel_group())
    assert cp_ranks == [rank % 2, rank % 2 + 2], cp_ranks
    # NxD's ring pairs through NxD's own module path (its compat copy returned [] at any CP).
    assert ps.get_context_model_parallel_src_tgt_pairs() == [[0, 2], [2, 0], [1, 3], [3, 1]]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=4)
    assert ps.get_expert_model_parallel_size() == 4
    assert ps.get_expert_model_parallel_rank() == rank
    assert ps.get_expert_model_parallel_group(as_list=True) == [[0, 1, 2, 3]]
    assert ps.get_expert_data_parallel_size() == 1
    _moe_runs_at_ep4()
    ps.destroy_model_parallel()
    with pytest.raises(
        ValueError, match=r"expert_model_parallel_size\(3\).*data_parallel_size\(4\)"
    ):
        ps.initialize_model_parallel(expert_model_parallel_size=3)
    assert not ps.model_parallel_is_initialized()


def _moe_runs_at_ep4() -> None:
    """NxD's MoE names import from NxD's paths and route, dispatch and combine at EP=4."""
    from neuronx_distributed.modules.moe import (
        MoE,
        RouterTopK,
        load_balancing_loss_func,
    )
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs

    torch.manual_seed(0)
    router = RouterTopK(num_experts=4, top_k=2, hidden_size=8)
    experts = ExpertMLPs(
        num_experts=4, top_k=2, hidden_size=8, intermediate_size=16,
        hidden_act="silu", glu_mlp=True, capacity_factor=None,
    )  # fmt: skip
    moe = MoE(router=router, expert_mlps=experts, return_router_logits=True)
    x = torch.randn(3, 2, 8, requires_grad=True)
    out, logits = moe(x)[:2]
    assert out.shape == x.shape
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert x.grad is not None
    assert torch.isfinite(x.grad).all()
    assert torch.isfinite(load_balancing_loss_func(logits, 4, 2))


def check_kv_groups() -> None:
    from neuronx_distributed.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    ps.initialize_kv_group(2)  # NxD's default: ranks TP/2 apart hold the same KV head
    assert ps.get_kv_shared_group_size() == 2
    assert ps.get_kv_shared_replica_groups() == [[0, 2], [1, 3]]
    assert ps.get_kv_shared_group(as_list=True) == [[0, 2], [1, 3]]
    rank = torch.distributed.get_rank()
    assert torch.distributed.get_process_group_ranks(ps.get_kv_shared_group()) == [
        rank % 2,
        rank % 2 + 2,
    ]
    ps.destroy_kv_group()
    with pytest.raises(RuntimeError, match="initialize_kv_group"):
        ps.get_kv_shared_group()
    ps.initialize_kv_group(kv_shared_group_size=2, sequential_ranks_in_group=True)
    assert ps.get_kv_shared_group(as_list=True) == [[0, 1], [2, 3]]
    ps.destroy_kv_group()
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()


def check_replica_groups_and_getters() -> None:
    from neuronx_distributed import parallel_state as top_level
    from neuronx_distributed.parallel_layers import parallel_state as ps

    assert top_level.get_data_parallel_replica_groups is ps.get_data_parallel_replica_groups
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=1,
        expert_model_parallel_size=1,
    )
    rank = torch.distributed.get_rank()
    tp_groups, pp_groups, dp_groups = [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0], [1], [2], [3]]
    assert ps.get_tensor_model_parallel_replica_groups() == tp_groups
    assert ps.get_pipeline_model_parallel_replica_groups() == pp_groups
    assert ps.get_data_parallel_replica_groups() == dp_groups
    assert ps.get_tensor_model_parallel_group(as_list=True) == tp_groups
    assert ps.get_pipeline_model_parallel_group(as_list=True) == pp_groups
    assert ps.get_data_parallel_group(as_list=True) == dp_groups
    tp, pp = rank % 2, rank // 2
    assert (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()) == (tp, pp)
    assert ps.get_tensor_model_parallel_src_rank() == 2 * pp
    assert ps.get_data_parallel_src_rank() == rank
    assert (ps.get_context_model_parallel_size(), ps.get_context_model_parallel_rank()) == (1, 0)
    assert (ps.get_expert_model_parallel_size(), ps.get_expert_model_parallel_rank()) == (1, 0)
    assert ps.get_expert_data_parallel_size() == ps.get_data_parallel_size() == 1
    cp_group = ps.get_context_model_parallel_group()
    assert torch.distributed.get_process_group_ranks(cp_group) == [rank]
    assert ps.rmsg("hello") == f"[rank_{rank}_pp{pp}_tp{tp}_dp0] hello"


def check_pipeline_comm() -> None:
    from neuronx_distributed.parallel_layers import parallel_state as ps
    from neuronx_distributed.pipeline.comm import recv_from, send

    meta = SimpleNamespace(shape=(2, 3), dtype=torch.float32, requires_grad=True)
    rank = torch.distributed.get_rank()
    if ps.get_pipeline_model_parallel_rank() == 0:
        send(torch.full((2, 3), float(rank)), send_next=True)
        back = recv_from(meta, recv_prev=False)  # from the next stage
        torch.testing.assert_close(back, torch.full((2, 3), float(rank + 2)), rtol=0, atol=0)
    else:
        got = recv_from(meta, recv_prev=True)
        assert got.requires_grad
        torch.testing.assert_close(got, torch.full((2, 3), float(rank - 2)), rtol=0, atol=0)
        send(torch.full((2, 3), float(rank)), send_next=False)


class _Keep(logging.Handler):
    """Keeps the messages a logger emits."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_logger() -> None:
    from neuronx_distributed.utils.logger import get_logger

    rank = torch.distributed.get_rank()
    for rank0_only in (True, False):
        logger = get_logger(f"nxd-compat-test-{rank0_only}", rank0_only=rank0_only)
        keep = _Keep()
        logger.addHandler(keep)
        logger.info("hello from %d", rank)
        records = keep.messages
        speaks = rank == 0 or not rank0_only
        assert records == ([f"hello from {rank}"] if speaks else []), (rank0_only, records)


def parallel_state_suite() -> list[str]:
    return run_named_checks(
        {
            "CP=2 groups, EP > 1 refused": check_context_parallel_and_unsupported_ep,
            "KV-shared groups at TP=4": check_kv_groups,
            "replica groups and getters at TP=2 x PP=2": check_replica_groups_and_getters,
            "pipeline.comm send/recv_from": check_pipeline_comm,
            "logger rank0_only": check_logger,
        },
        context=f"rank {torch.distributed.get_rank()}",
    )


def test_nxd_parallel_state_scripts() -> None:
    results = run_distributed(parallel_state_suite, WORLD)
    assert all(len(names) == 5 for names in results)
