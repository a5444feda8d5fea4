"""Collectives on every backend: a tensor on a device the group's backend cannot use is staged
through the backend's device (copied in, the op run on the copy, the result copied back).

No GPU or XLA device here: the decision is tested as a table, and the staging path on gloo ranks
whose backend is declared to accept no device at all, so every tensor really is copied (to the
CPU) before the op: every op must still equal its definition in place, hand torch.distributed
only staging copies, and be counted exactly as without staging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nxd_state import _staging
from nxd_state import collectives as C
from nxd_state._staging import BackendDevices, backend_devices, staging_device_type
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}  # staging copies numbers, it computes nothing


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("gloo", "cpu", None),
        ("gloo", "cuda", None),  # gloo takes CUDA tensors too
        ("gloo", "xla", "cpu"),
        ("nccl", "cpu", "cuda"),  # a CPU flag on an NCCL group
        ("nccl", "cuda", None),
        ("NCCL", "xla", "cuda"),
        ("xla", "cpu", "xla"),
        ("xla", "xla", None),
        ("cpu:gloo,cuda:nccl", "cpu", None),  # one group, a backend per device type
        ("cpu:gloo,cuda:nccl", "cuda", None),
        ("cpu:gloo,cuda:nccl", "xla", "cpu"),
        ("nccl", "meta", None),  # no data to copy: the backend answers for itself
        ("some-plugin", "cpu", None),  # unknown backend: tensors passed as they are
    ],
)
def test_staging_device_type_per_backend(backend: str, device: str, expected: str | None) -> None:
    assert staging_device_type(backend, device) == expected


def test_backend_devices_table() -> None:
    assert backend_devices("nccl") == BackendDevices(frozenset({"cuda"}), "cuda")
    assert backend_devices("cpu:gloo,cuda:nccl") == BackendDevices(
        frozenset({"cpu", "cuda"}), "cpu"
    )
    assert backend_devices("mpi") is None


# On the ranks --------------------------------------------------------------------------------
# The tensors handed to torch.distributed, kept alive so no later tensor can reuse the memory
# of a freed staging copy (addresses are compared at the end).
_HANDED: list[torch.Tensor] = []
_SPIED = (
    "all_reduce",
    "broadcast",
    "all_gather_into_tensor",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _spy(name: str) -> Callable[..., Any]:
    real = getattr(dist, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        for value in [*args, *kwargs.values()]:
            if isinstance(value, torch.Tensor):
                _HANDED.append(value)
        return real(*args, **kwargs)

    return spy


def _install_spies() -> None:
    real = {name: getattr(dist, name) for name in _SPIED}
    for name in _SPIED:
        setattr(dist, name, _spy(name))
    unspied = {getattr(dist, name): real[name] for name in ("isend", "irecv")}
    real_p2p = dist.P2POp

    def p2p(op: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _HANDED.append(tensor)
        return real_p2p(unspied.get(op, op), tensor, *args, **kwargs)  # P2POp checks op

    dist.P2POp = p2p  # type: ignore[misc, assignment]


def _ops(rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Every op once, on CPU tensors; (results by op, every tensor the caller handed in)."""
    base = torch.arange(12.0).reshape(4, 3)
    mine = base * (rank + 1)
    peer = 1 - rank
    out: dict[str, torch.Tensor] = {}
    callers: list[torch.Tensor] = []

    x = mine.clone()
    callers.append(x)
    assert C.all_reduce(x) is x
    out["all_reduce"] = x
    x = mine.clone()
    callers.append(x)
    assert C.broadcast(x, src=1) is x
    out["broadcast"] = x
    callers.append(mine)
    out["all_gather"] = C.all_gather(mine, dim=1)
    gathered = torch.zeros(2 * world, 3)
    shard = gathered[2 * rank : 2 * rank + 2]
    shard.copy_(mine[:2])  # this rank's chunk of out, in place
    callers.append(gathered)
    assert C.all_gather(shard, out=gathered) is gathered
    out["all_gather_out"] = gathered
    out["reduce_scatter"] = C.reduce_scatter(mine, dim=0)
    out["reduce_scatter_dim1"] = C.reduce_scatter(mine[:, :2], dim=1)
    out["all_to_all"] = C.all_to_all(mine, scatter_dim=0, gather_dim=1)

    received = torch.zeros(4, 3)
    callers.append(received)
    if rank == 0:
        C.send(mine, dst=1)
    else:
        C.recv(received, src=0)
    out["recv"] = received
    late = torch.full((4, 3), -1.0)
    callers.append(late)
    sending = C.isend(mine, dst=peer)
    receiving = C.irecv(late, src=peer)
    sending.wait()
    receiving.wait()
    out["irecv"] = late
    crossed = torch.zeros(4, 3)
    callers.append(crossed)
    C.batch_send_recv([C.P2POp("send", mine, peer), C.P2POp("recv", crossed, peer)])
    out["batch_recv"] = crossed
    buckets = [mine.clone(), mine[0].clone()]
    callers.extend(buckets)
    C.all_reduce_bucketed(buckets, None, average=True, bucket_cap_bytes=64)
    out["bucketed"] = torch.cat([buckets[0].reshape(-1), buckets[1]])
    return out, callers


def staged_ops(stage_everything: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if stage_everything:  # gloo takes nothing as it is: every tensor goes through a copy
        _staging._BACKEND_DEVICES["gloo"] = BackendDevices(frozenset(), "cpu")
    _install_spies()
    with C.count_collectives() as counter:
        out, callers = _ops(rank, world)
    handed = {t.untyped_storage().data_ptr() for t in _HANDED}
    shared = [t for t in callers if t.untyped_storage().data_ptr() in handed]
    return {"out": out, "shared": len(shared), "counter": counter.as_dict()}


def test_every_op_stages_through_the_backend_device_in_place() -> None:
    staged = run_distributed(staged_ops, 2, True)
    plain = run_distributed(staged_ops, 2, False)
    base = torch.arange(12.0).reshape(4, 3)
    inputs = [base, base * 2]
    total = inputs[0] + inputs[1]
    for rank, result in enumerate(staged):
        out = result["out"]
        # The definitions, in place where the op is in place.
        torch.testing.assert_close(out["all_reduce"], total, **EXACT)
        torch.testing.assert_close(out["broadcast"], inputs[1], **EXACT)
        torch.testing.assert_close(out["all_gather"], torch.cat(inputs, dim=1), **EXACT)
        torch.testing.assert_close(
            out["all_gather_out"], torch.cat([x[:2] for x in inputs]), **EXACT
        )
        torch.testing.assert_close(out["reduce_scatter"], total.chunk(2)[rank], **EXACT)
        torch.testing.assert_close(
            out["reduce_scatter_dim1"], total[:, :2].chunk(2, dim=1)[rank], **EXACT
        )
        expected_a2a = torch.cat([x.chunk(2)[rank] for x in inputs], dim=1)
        torch.testing.assert_close(out["all_to_all"], expected_a2a, **EXACT)
        torch.testing.assert_close(out["recv"], inputs[0] if rank else torch.zeros(4, 3), **EXACT)
        torch.testing.assert_close(out["irecv"], inputs[1 - rank], **EXACT)
        torch.testing.assert_close(out["batch_recv"], inputs[1 - rank], **EXACT)
        mean = torch.cat([total.reshape(-1), total[0]]) / 2
        torch.testing.assert_close(out["bucketed"], mean, **EXACT)
        # Every tensor torch.distributed saw was a staging copy, none the caller's memory ...
        assert result["shared"] == 0
        # ... and staging is not traffic: the same counts as without it, op for op.
        assert result["counter"] == plain[rank]["counter"]
    # Without staging the backend works on the callers' tensors (the spy sees them).
    assert all(result["shared"] > 0 for result in plain)
    for rank, result in enumerate(plain):
        for name, value in result["out"].items():
            torch.testing.assert_close(staged[rank]["out"][name], value, **EXACT, msg=name)


def staged_irecv_waits() -> list[float]:
    """A staged receive writes the caller's tensor in wait(), not before."""
    rank = dist.get_rank()
    _staging._BACKEND_DEVICES["gloo"] = BackendDevices(frozenset(), "cpu")
    if rank == 0:
        C.send(torch.full((3,), 7.0), dst=1)
        dist.barrier()
        return []
    target = torch.zeros(3)
    work = C.irecv(target, src=0)
    dist.barrier()  # the send has been posted and left rank 0
    before = target.tolist()
    work.wait()
    return before + target.tolist()


def test_staged_irecv_fills_the_tensor_at_wait() -> None:
    assert run_distributed(staged_irecv_waits, 2)[1] == [0.0, 0.0, 0.0, 7.0, 7.0, 7.0]
