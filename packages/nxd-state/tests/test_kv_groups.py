"""KV-shared groups (NxD's initialize_kv_group) built on 4 and 8 gloo ranks.

The proof that a group is right is semantic: every rank builds its shard of a K weight whose
heads are replicated the way the group order assumes (block-wise for NxD's interleaved groups,
head by head for sequential ones), then gathers its KV-shared group's shards. Every member
must hold exactly the same heads. Head rows are small integers, so comparisons are exact.
"""

import pytest
import torch
import torch.distributed as dist

import nxd_state as ps
from nxd_state import collectives as C
from nxd_state.testing import run_distributed


def local_k_shard(kv_heads: int, multiplier: int, sequential: bool) -> torch.Tensor:
    """This TP rank's rows of a K weight with ``kv_heads`` heads (head h's row is h), each
    replicated ``multiplier`` times, split evenly over the TP group."""
    heads = torch.arange(kv_heads, dtype=torch.float32)
    replicated = heads.repeat_interleave(multiplier) if sequential else heads.repeat(multiplier)
    return replicated.chunk(ps.get_tensor_model_parallel_size())[
        ps.get_tensor_model_parallel_rank()
    ]


def build_kv_groups(tp: int, kv_heads: int, multiplier: int, sequential: bool) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    ps.initialize_kv_group(multiplier, sequential_ranks_in_group=sequential)
    group = ps.get_kv_shared_group()
    shard = local_k_shard(kv_heads, multiplier, sequential)
    members = C.all_gather(shard.unsqueeze(0), group=group)  # (multiplier, rows)
    tp_group = ps.get_tensor_model_parallel_group()
    tp_shards = C.all_gather(shard.unsqueeze(0), group=tp_group)  # (tp, rows)
    holders = [
        global_rank
        for global_rank, other in zip(dist.get_process_group_ranks(tp_group), tp_shards)
        if torch.equal(other, shard)
    ]
    rank_sum = torch.tensor([float(dist.get_rank())])
    C.all_reduce(rank_sum, group=group)
    again = ps.initialize_kv_group(multiplier, sequential_ranks_in_group=sequential)
    return {
        "ranks": dist.get_process_group_ranks(group),
        "rank_sum": rank_sum.item(),
        "size": ps.get_kv_shared_group_size(),
        "replica": ps.get_kv_shared_replica_groups(),
        "as_list": ps.get_kv_shared_group(as_list=True),
        "shard": shard,
        "members": members,
        "holders": holders,
        "idempotent": again is None and ps.get_kv_shared_group() is group,
    }


@pytest.mark.parametrize(
    ("world", "tp", "kv_heads", "multiplier", "sequential"),
    [
        (4, 4, 2, 2, False),  # TP=4, 2 KV heads, each held twice: ranks {0,2}, {1,3}
        (4, 4, 2, 2, True),  # the same, heads adjacent: ranks {0,1}, {2,3}
        (8, 8, 2, 4, False),  # TP=8 with 2 KV heads: {0,2,4,6}, {1,3,5,7}
        (8, 8, 2, 4, True),
        (8, 4, 1, 4, False),  # DP=2: one group per TP group
        (8, 8, 4, 4, False),  # two heads per rank, block-wise: {0,2,4,6}, {1,3,5,7}
    ],
)
def test_kv_groups_are_the_ranks_holding_the_same_heads(
    world: int, tp: int, kv_heads: int, multiplier: int, sequential: bool
) -> None:
    layout = ps.ParallelLayout(world_size=world, tensor_parallel_size=tp)
    expected_groups = layout.kv_shared_groups(multiplier, sequential_ranks_in_group=sequential)
    for rank, out in enumerate(
        run_distributed(build_kv_groups, world, tp, kv_heads, multiplier, sequential)
    ):
        mine = next(g for g in expected_groups if rank in g)
        assert out["ranks"] == mine
        assert out["rank_sum"] == sum(mine)
        assert out["size"] == multiplier
        assert out["replica"] == out["as_list"] == expected_groups
        assert out["idempotent"]
        # Every member of the group holds this rank's heads, and no other rank does.
        for member in out["members"]:
            torch.testing.assert_close(member, out["shard"], rtol=0, atol=0)
        assert out["holders"] == mine


def kv_errors() -> dict:
    out = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    try:
        ps.get_kv_shared_group()
    except RuntimeError as error:
        out["before"] = str(error)
    try:
        ps.initialize_kv_group(3)
    except ValueError as error:
        out["indivisible"] = str(error)
    ps.initialize_kv_group(2)
    try:
        ps.initialize_kv_group(4)
    except ValueError as error:
        out["other_size"] = str(error)
    ps.destroy_kv_group()
    try:
        ps.get_kv_shared_group_size()
    except RuntimeError as error:
        out["after_destroy_kv"] = str(error)
    ps.initialize_kv_group(4, sequential_ranks_in_group=True)  # a new layout after destroy
    out["rebuilt"] = dist.get_process_group_ranks(ps.get_kv_shared_group())
    state = ps.get_parallel_state()
    ps.destroy_model_parallel()
    out["destroyed_with_state"] = state.kv_shared is None
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    try:
        ps.get_kv_shared_replica_groups()
    except RuntimeError as error:
        out["fresh_state"] = str(error)
    return out


def test_kv_group_errors_and_lifecycle() -> None:
    for out in run_distributed(kv_errors, 4):
        for key in ("before", "after_destroy_kv", "fresh_state"):
            assert "KV-shared group is not initialized: call initialize_kv_group" in out[key]
        assert (
            "kv_shared_group_size(3) does not divide tensor_parallel_size(4)"
            in (out["indivisible"])
        )
        assert "already exist with kv_shared_group_size=2" in out["other_size"]
        assert "cannot build kv_shared_group_size=4" in out["other_size"]
        assert out["rebuilt"] == [0, 1, 2, 3]
        assert out["destroyed_with_state"]


def test_kv_group_needs_model_parallel_state() -> None:
    with pytest.raises(RuntimeError, match=r"model parallel state is not initialized"):
        ps.initialize_kv_group(2)
