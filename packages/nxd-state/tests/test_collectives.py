"""Every collective against its definition on 2 and 4 gloo ranks, and the traffic counter.

Inputs are small integers in float32, so sums are exact: every comparison is exact
(``rtol=atol=0``).
"""

import pytest
import torch
import torch.distributed as dist

from nxd_state import collectives as C
from nxd_state import count_collectives
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}


def rank_tensor(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A distinct, exactly representable tensor per rank."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 100 * rank


def run_all(shape: tuple[int, ...], dim: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    x = rank_tensor(rank, shape)
    with count_collectives() as counter:
        out = {
            "all_reduce": C.all_reduce(x.clone()),
            "all_reduce_max": C.all_reduce(x.clone(), op=dist.ReduceOp.MAX),
            "all_gather": C.all_gather(x, dim=dim),
            "reduce_scatter": C.reduce_scatter(x, dim=dim),
            "all_to_all": C.all_to_all(x, scatter_dim=dim, gather_dim=0),
            "broadcast": C.broadcast(x.clone(), src=n - 1),
        }
        # Ring exchange with p2p: send to the next rank, receive from the previous one.
        received = torch.empty_like(x)
        C.batch_send_recv(
            [C.P2POp("send", x, (rank + 1) % n), C.P2POp("recv", received, (rank - 1) % n)]
        )
        out["ring"] = received
        if rank == 0:
            C.send(x, dst=1)
        elif rank == 1:
            out["recv"] = C.recv(torch.empty_like(x), src=0)
        C.barrier()
    out["counter"] = counter.as_dict()
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("shape", "dim"), [((4, 3), 0), ((2, 8), 1), ((2, 4, 4), -1)])
def test_collectives_match_definitions(world: int, shape: tuple[int, ...], dim: int) -> None:
    results = run_distributed(run_all, world, shape, dim)
    inputs = [rank_tensor(r, shape) for r in range(world)]
    total = sum(inputs)
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["all_reduce"], total, **EXACT)
        torch.testing.assert_close(out["all_reduce_max"], inputs[-1], **EXACT)
        torch.testing.assert_close(out["all_gather"], torch.cat(inputs, dim=dim), **EXACT)
        torch.testing.assert_close(
            out["reduce_scatter"], total.chunk(world, dim=dim)[rank], **EXACT
        )
        # all-to-all: chunk `rank` of every rank's input, in source-rank order.
        expected_a2a = torch.cat([x.chunk(world, dim=dim)[rank] for x in inputs], dim=0)
        torch.testing.assert_close(out["all_to_all"], expected_a2a, **EXACT)
        torch.testing.assert_close(out["broadcast"], inputs[-1], **EXACT)
        torch.testing.assert_close(out["ring"], inputs[(rank - 1) % world], **EXACT)
        if rank == 1:
            torch.testing.assert_close(out["recv"], inputs[0], **EXACT)


def test_counter_records_payload_and_ring_wire_bytes() -> None:
    world, shape = 4, (4, 3)
    counter = run_distributed(run_all, world, shape, 0)[0]["counter"]
    nbytes = 4 * 3 * 4  # 12 float32
    assert counter["all_reduce@world"] == {
        "calls": 2,
        "bytes": 2 * nbytes,
        "wire_bytes": 2 * 2 * 3 / 4 * nbytes,
    }
    assert counter["all_gather@world"] == {"calls": 1, "bytes": nbytes, "wire_bytes": 3 * nbytes}
    assert counter["reduce_scatter@world"] == {
        "calls": 1,
        "bytes": nbytes,
        "wire_bytes": 3 / 4 * nbytes,
    }
    assert counter["all_to_all@world"] == {
        "calls": 1,
        "bytes": nbytes,
        "wire_bytes": 3 / 4 * nbytes,
    }
    assert counter["broadcast@world"] == {
        "calls": 1,
        "bytes": nbytes,
        "wire_bytes": 0,
    }  # rank 0 is no source
    assert counter["send@world"] == {"calls": 2, "bytes": 2 * nbytes, "wire_bytes": 2 * nbytes}
    assert counter["recv@world"] == {"calls": 1, "bytes": nbytes, "wire_bytes": 0}


def count_in_named_groups() -> dict:
    import nxd_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    x = torch.ones(8)
    with count_collectives() as counter:
        C.all_reduce(x, group=ps.get_tensor_model_parallel_group())
        C.all_reduce(x, group=ps.get_data_parallel_group())
        C.all_gather(x, group=ps.get_data_parallel_group())
    return {
        "keys": sorted(counter.as_dict()),
        "dp_total_bytes": counter.total(group="dp").bytes,
        "all_reduce_calls": counter.total(op="all_reduce").calls,
    }


def test_counter_keys_use_parallel_state_group_names() -> None:
    result = run_distributed(count_in_named_groups, 4)[0]
    assert result["keys"] == ["all_gather@dp", "all_reduce@dp", "all_reduce@tp"]
    assert result["dp_total_bytes"] == 2 * 8 * 4
    assert result["all_reduce_calls"] == 2


def single_rank_group_is_free() -> dict:
    group = dist.new_group([dist.get_rank()]) if dist.get_world_size() > 1 else None
    x = torch.arange(4.0)
    with count_collectives() as counter:
        outs = [
            C.all_reduce(x, group=group),
            C.all_gather(x, group=group),
            C.reduce_scatter(x, group=group),
        ]
    return {"same": all(o is x for o in outs), "stats": counter.as_dict()}


def test_groups_of_one_do_not_communicate() -> None:
    for result in run_distributed(single_rank_group_is_free, 2):
        assert result == {"same": True, "stats": {}}


def bad_reduce_scatter() -> str:
    try:
        C.reduce_scatter(torch.ones(3))
    except ValueError as error:
        return str(error)
    return "no error"


def test_reduce_scatter_indivisible_size_is_a_clear_error() -> None:
    messages = run_distributed(bad_reduce_scatter, 2)
    assert all("size 3 of dim 0 is not divisible by the group size 2" in m for m in messages)


def nonblocking_exchange() -> dict:
    """Both ranks start all their sends, post all receives before waiting on any, then wait."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    shapes = [(3,), (2, 5), (4, 1, 2)]
    with count_collectives() as counter:
        sends = [C.isend(rank_tensor(rank, s), dst=peer) for s in shapes]
        received = [torch.empty(s) for s in shapes]
        recvs = [C.irecv(t, src=peer) for t in received]
        for work in recvs + sends:
            work.wait()
    return {"received": received, "counter": counter.as_dict()}


def test_isend_irecv_match_in_posting_order_without_deadlock() -> None:
    shapes = [(3,), (2, 5), (4, 1, 2)]
    results = run_distributed(nonblocking_exchange, 2)
    nbytes = 4 * sum(torch.Size(s).numel() for s in shapes)
    for rank, out in enumerate(results):
        for shape, tensor in zip(shapes, out["received"]):
            torch.testing.assert_close(tensor, rank_tensor(1 - rank, shape), **EXACT)
        assert out["counter"]["send@world"] == {"calls": 3, "bytes": nbytes, "wire_bytes": nbytes}
        assert out["counter"]["recv@world"] == {"calls": 3, "bytes": nbytes, "wire_bytes": 0}


def test_isend_rejects_a_non_contiguous_tensor() -> None:
    with pytest.raises(ValueError, match=r"contiguous tensor \(shape \(3, 2\)\)"):
        C.isend(torch.ones(2, 3).t(), dst=0)


def bucketed_mean() -> dict:
    rank = dist.get_rank()
    tensors = [
        rank_tensor(rank, (3, 2)),
        rank_tensor(rank, (5,)).double(),
        rank_tensor(rank, (4,)),
        rank_tensor(rank, (2, 2)),
    ]
    with count_collectives() as counter:
        # 40 bytes: the float32 (3, 2) alone, the float64 alone, then (4,) + (2, 2) together.
        C.all_reduce_bucketed(tensors, None, average=True, bucket_cap_bytes=40)
    return {"tensors": tensors, "calls": counter.total(op="all_reduce").calls}


def test_all_reduce_bucketed_averages_every_tensor_in_few_collectives() -> None:
    results = run_distributed(bucketed_mean, 2)
    shapes = [(3, 2), (5,), (4,), (2, 2)]
    for out in results:
        assert out["calls"] == 3
        for shape, tensor in zip(shapes, out["tensors"]):
            expected = (rank_tensor(0, shape) + rank_tensor(1, shape)) / 2
            torch.testing.assert_close(tensor, expected.to(tensor.dtype), **EXACT)


def all_to_all_emulated(shape: tuple[int, ...], dim: int, force: bool) -> dict:
    """all_to_all with the native op either refused by the backend (as gloo refuses the list
    form through torch 2.11) or marked missing up front; counts the native attempts."""
    rank = dist.get_rank()
    attempts = []
    native = dist.all_to_all_single
    if force:
        C._NO_NATIVE_ALL_TO_ALL.add(C._backend_name(None))
    else:

        def refuse(*args: object, **kwargs: object) -> None:
            attempts.append(1)
            raise RuntimeError("Backend gloo does not support alltoall_base")

        dist.all_to_all_single = refuse
    try:
        with count_collectives() as counter:
            first = C.all_to_all(rank_tensor(rank, shape), scatter_dim=dim, gather_dim=0)
            second = C.all_to_all(rank_tensor(rank, shape), scatter_dim=dim, gather_dim=dim)
    finally:
        dist.all_to_all_single = native
    return {
        "first": first,
        "second": second,
        "attempts": len(attempts),
        "missing": sorted(C._NO_NATIVE_ALL_TO_ALL),
        "counter": counter.as_dict(),
    }


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize(("world", "shape", "dim"), [(2, (4, 3), 0), (4, (2, 8), 1)])
def test_all_to_all_emulation_matches_definition_and_counts_native_volume(
    world: int, shape: tuple[int, ...], dim: int, force: bool
) -> None:
    results = run_distributed(all_to_all_emulated, world, shape, dim, force)
    inputs = [rank_tensor(r, shape) for r in range(world)]
    nbytes = 4 * torch.Size(shape).numel()
    for rank, out in enumerate(results):
        chunks = [x.chunk(world, dim=dim)[rank] for x in inputs]
        torch.testing.assert_close(out["first"], torch.cat(chunks, dim=0), **EXACT)
        torch.testing.assert_close(out["second"], torch.cat(chunks, dim=dim), **EXACT)
        # The missing op is detected once, then emulated without asking the backend again.
        assert out["attempts"] == (0 if force else 1)
        assert out["missing"] == ["gloo"]
        # Pairwise sends move (n-1)/n of the input, the native all-to-all volume: nothing else
        # (no send/recv entries) is counted.
        assert out["counter"] == {
            "all_to_all@world": {
                "calls": 2,
                "bytes": 2 * nbytes,
                "wire_bytes": 2 * (world - 1) / world * nbytes,
            }
        }


def reduce_scatter_emulated() -> dict:
    """A backend with neither a reduce-scatter nor an all-to-all: the all-reduce emulation."""
    rank = dist.get_rank()
    C._NO_NATIVE_REDUCE_SCATTER.add(C._backend_name(None))
    C._NO_NATIVE_ALL_TO_ALL.add(C._backend_name(None))
    with count_collectives() as counter:
        out = C.reduce_scatter(rank_tensor(rank, (4, 3)), dim=0)
    return {"out": out, "counter": counter.as_dict()}


def test_emulated_reduce_scatter_counts_the_all_reduce_it_sends() -> None:
    world, nbytes = 2, 4 * 3 * 4
    total = rank_tensor(0, (4, 3)) + rank_tensor(1, (4, 3))
    for rank, out in enumerate(run_distributed(reduce_scatter_emulated, world)):
        torch.testing.assert_close(out["out"], total.chunk(world)[rank], **EXACT)
        assert out["counter"] == {
            "reduce_scatter@world": {
                "calls": 1,
                "bytes": nbytes,
                "wire_bytes": 2 * (world - 1) / world * nbytes,
            }
        }


def all_to_all_failure_mid_transfer() -> str:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Connection closed by peer")

    native, dist.all_to_all_single = dist.all_to_all_single, broken
    try:
        C.all_to_all(torch.ones(4))
    except RuntimeError as error:
        return f"{error} | missing={sorted(C._NO_NATIVE_ALL_TO_ALL)}"
    finally:
        dist.all_to_all_single = native
    return "no error"


def test_all_to_all_failure_that_is_not_a_missing_op_is_raised() -> None:
    for message in run_distributed(all_to_all_failure_mid_transfer, 2):
        assert message == "Connection closed by peer | missing=[]"
