"""Stage-to-stage transfers through ``nxd_state.collectives.batch_send_recv``.

A receiver must allocate buffers of the right shape and dtype. The first time a stage sends
its activations for a given input signature, a fixed-size int64 header travels first:
``[n, (dtype, requires_grad, ndim, d0..d5) x n]``; both ends cache it, so later steps send
the tensors alone. Gradients need no header: their shapes are those of the activations the
receiver itself produced.

Two modes. *Asynchronous sends* (gloo): each peer has a sender thread that issues this
rank's sends to it in program order, so a rank never waits for a peer to take its data; the
main thread receives one transfer at a time (header, then data), so every link carries
header/data pairs in one canonical order. *Synchronous batches* (other backends, where
sends from a second thread could reorder a communicator's operations): all of a batch's
sends and receives are issued together and waited for, headers first.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from nxd_state import collectives

__all__ = ["AsyncSenders", "TensorMeta", "Transfer", "exchange", "exchange_async"]

_HEADER = 256
_FIELDS = 9  # dtype, requires_grad, ndim, up to 6 dims
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
]


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether the receiver should track gradients for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class Transfer:
    """One send (``tensors`` given) or receive (``tensors`` filled in) with ``peer``."""

    send: bool
    peer: int
    key: Hashable
    """Identifies the link in the header cache (e.g. ("F", producer stage, signature))."""
    tensors: list[torch.Tensor] | None = None
    metas: list[TensorMeta] | None = None
    """Receive side: known shapes (gradients); None means "from the header cache/exchange"."""


def _encode(tensors: Sequence[torch.Tensor], key: Hashable) -> torch.Tensor:
    if 1 + _FIELDS * len(tensors) > _HEADER:
        raise ValueError(
            f"{key}: {len(tensors)} tensors cross one stage boundary; at most "
            f"{(_HEADER - 1) // _FIELDS} are supported: cut the model elsewhere"
        )
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES or t.dim() > 6:
            raise ValueError(f"{key}: cannot send a {t.dtype} tensor of {t.dim()} dims")
        row = [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
        header[1 + i * _FIELDS : 1 + i * _FIELDS + len(row)] = torch.tensor(row)
    return header


def _decode(header: torch.Tensor) -> list[TensorMeta]:
    values = header.tolist()
    out = []
    for i in range(values[0]):
        dtype, grad, ndim, *dims = values[1 + i * _FIELDS : 1 + (i + 1) * _FIELDS]
        out.append(TensorMeta(tuple(dims[:ndim]), _DTYPES[dtype], bool(grad)))
    return out


def exchange(
    transfers: list[Transfer],
    cache: dict[Hashable, list[TensorMeta]],
    device: torch.device,
    group: ProcessGroup | None,
) -> None:
    """Run ``transfers`` as one batch (headers first where not cached); fills receives."""
    headers: list[tuple[Transfer, torch.Tensor]] = []
    links = [(t.send, t.peer) for t in transfers if t.metas is None and t.key not in cache]
    if len(links) != len(set(links)):
        # Headers go first in a batch: two on one link would interleave differently from a
        # peer that receives these transfers in separate batches. Generated schedules never
        # do this (each stage boundary's first transfer travels alone on its link).
        raise RuntimeError(
            f"a synchronous p2p batch carries first-step headers for several transfers on one "
            f"link ({sorted(links)}): split the schedule's communication, or use asynchronous "
            f"sends"
        )
    for transfer in transfers:
        if transfer.send and transfer.metas is None and transfer.key not in cache:
            assert transfer.tensors is not None
            cache[transfer.key] = [
                TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in transfer.tensors
            ]
            headers.append((transfer, _encode(transfer.tensors, transfer.key).to(device)))
        elif not transfer.send and transfer.metas is None and transfer.key not in cache:
            headers.append((transfer, torch.zeros(_HEADER, dtype=torch.int64, device=device)))
    if headers:
        collectives.batch_send_recv(
            [collectives.P2POp("send" if t.send else "recv", h, t.peer, group) for t, h in headers]
        )
        for transfer, header in headers:
            if not transfer.send:
                cache[transfer.key] = _decode(header)
    ops = []
    for transfer in transfers:
        if transfer.send:
            assert transfer.tensors is not None
            for tensor in transfer.tensors:
                ops.append(
                    collectives.P2POp("send", tensor.detach().contiguous(), transfer.peer, group)
                )
        else:
            metas = transfer.metas if transfer.metas is not None else cache[transfer.key]
            transfer.tensors = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
            ops += [collectives.P2POp("recv", t, transfer.peer, group) for t in transfer.tensors]
    collectives.batch_send_recv(ops)
    for transfer in transfers:
        if not transfer.send and transfer.metas is None:
            for tensor, meta in zip(transfer.tensors or [], cache[transfer.key]):
                tensor.requires_grad_(meta.requires_grad)


@dataclass
class AsyncSenders:
    """One daemon thread per peer issuing this rank's sends to it, in submission order."""

    group: ProcessGroup | None
    queues: dict[int, queue.Queue] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def submit(self, peer: int, tensors: list[torch.Tensor]) -> None:
        if peer not in self.queues:
            self.queues[peer] = queue.Queue()
            thread = threading.Thread(
                target=self._loop, args=(self.queues[peer],), daemon=True, name=f"nxd-send-{peer}"
            )
            thread.start()
            self.threads.append(thread)
        self.queues[peer].put((peer, tensors))

    def _loop(self, jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                peer, tensors = job
                collectives.batch_send_recv(
                    [collectives.P2POp("send", t, peer, self.group) for t in tensors]
                )
            except BaseException as error:  # surfaced by drain() on the main thread
                self.errors.append(error)
            finally:
                jobs.task_done()

    def drain(self) -> None:
        """Wait until every submitted send has completed; re-raise a sender's error."""
        for jobs in self.queues.values():
            jobs.join()
        if self.errors:
            error = self.errors[0]
            self.errors.clear()
            raise RuntimeError(f"pipeline send failed: {error}") from error


def exchange_async(
    transfers: list[Transfer],
    cache: dict[Hashable, list[TensorMeta]],
    device: torch.device,
    senders: AsyncSenders,
) -> None:
    """Queue the sends (header first when new) and receive, one transfer at a time."""
    for transfer in transfers:
        if not transfer.send:
            continue
        assert transfer.tensors is not None
        tensors = [t.detach().contiguous() for t in transfer.tensors]
        if transfer.metas is None and transfer.key not in cache:
            cache[transfer.key] = [
                TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in transfer.tensors
            ]
            tensors.insert(0, _encode(transfer.tensors, transfer.key).to(device))
        senders.submit(transfer.peer, tensors)
    for transfer in transfers:
        if transfer.send:
            continue
        if transfer.metas is None and transfer.key not in cache:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
            collectives.batch_send_recv(
                [collectives.P2POp("recv", header, transfer.peer, senders.group)]
            )
            cache[transfer.key] = _decode(header.cpu())
        metas = transfer.metas if transfer.metas is not None else cache[transfer.key]
        transfer.tensors = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
        collectives.batch_send_recv(
            [collectives.P2POp("recv", t, transfer.peer, senders.group) for t in transfer.tensors]
        )
        if transfer.metas is None:
            for tensor, meta in zip(transfer.tensors, metas):
                tensor.requires_grad_(meta.requires_grad)
