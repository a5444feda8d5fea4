"""The non-blocking P2P batch: a ring shift of two tensors, received after ``wait()``."""

import torch
import torch.distributed as dist

from nxd_state import collectives
from nxd_state.collectives import P2POp
from nxd_state.testing import run_distributed


def ring_shift() -> tuple[list[float], list[float], dict]:
    rank, n = dist.get_rank(), dist.get_world_size()
    send = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank)]
    recv = [torch.empty(3), torch.empty(2, 2)]
    ops = [P2POp("send", t, (rank + 1) % n) for t in send]
    ops += [P2POp("recv", t, (rank - 1) % n) for t in recv]
    with collectives.count_collectives() as counter:
        work = collectives.start_batch_send_recv(ops)
        work.wait()
        work.wait()  # a second wait is a no-op
    return recv[0].tolist(), recv[1].flatten().tolist(), counter.as_dict()


def test_ring_shift_arrives_after_wait() -> None:
    n = 3
    for rank, (first, second, traffic) in enumerate(run_distributed(ring_shift, n)):
        prev = (rank - 1) % n
        assert first == [float(prev)] * 3
        assert second == [10.0 + prev] * 4
        sent = sum(v["wire_bytes"] for k, v in traffic.items() if k.startswith("send"))
        assert sent == (3 + 4) * 4  # both tensors, fp32, counted once
