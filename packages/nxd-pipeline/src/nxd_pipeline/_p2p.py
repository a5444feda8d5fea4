"""Stage-to-stage transfers through ``nxd_state.collectives.batch_send_recv``.

A receiver must allocate buffers of the right shape and dtype. The first time a stage sends
its activations for a given input signature, a fixed-size int64 header travels first:
``[n, (dtype, requires_grad, ndim, d0..d5) x n]``; both ends cache it, so later steps send
the tensors alone. Gradients need no header: their shapes are those of the activations the
receiver itself produced. A tensor with no elements is never sent: its shape (in the header or
known to the receiver) is all there is to it.

Two modes. *Non-blocking* (gloo): sends start and stay in flight until the end of the step,
so a rank never waits for a peer to take its data; receives are posted where the schedule
places them and waited for only when a compute needs their data, so an early receive never
stalls unrelated work. Both ends post a link's transfers in the same order (header before
data), and gloo matches them in posting order. *Synchronous batches* (other backends, where
a communicator orders its operations on one stream and crossing unbatched sends could
deadlock): all of a batch's sends and receives are issued together and waited for, headers
first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from nxd_state import collectives
from nxd_state.health import CheckedWork

__all__ = [
    "PendingReceive",
    "SendsInFlight",
    "TensorMeta",
    "Transfer",
    "exchange",
    "exchange_nonblocking",
]

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

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], *, grads: bool = False) -> list[TensorMeta]:
        """Metas of ``tensors``; ``grads``: gradient buffers, received without tracking."""
        return [cls(tuple(t.shape), t.dtype, t.requires_grad and not grads) for t in tensors]


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
            cache[transfer.key] = TensorMeta.of(transfer.tensors)
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
                if tensor.numel():
                    ops.append(
                        collectives.P2POp(
                            "send", tensor.detach().contiguous(), transfer.peer, group
                        )
                    )
        else:
            metas = transfer.metas if transfer.metas is not None else cache[transfer.key]
            transfer.tensors = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
            ops += [
                collectives.P2POp("recv", t, transfer.peer, group)
                for t in transfer.tensors
                if t.numel()
            ]
    collectives.batch_send_recv(ops)
    for transfer in transfers:
        if not transfer.send and transfer.metas is None:
            for tensor, meta in zip(transfer.tensors or [], cache[transfer.key]):
                tensor.requires_grad_(meta.requires_grad)


@dataclass
class PendingReceive:
    """Receives posted for one transfer; :meth:`wait` returns its tensors once they arrived."""

    tensors: list[torch.Tensor]
    works: list[CheckedWork]
    metas: list[TensorMeta] | None
    """Set ``requires_grad`` from these once the data is in (activations); None for grads."""

    def arrived(self) -> bool:
        """True once every receive has completed (never blocks)."""
        return all(work.is_completed() for work in self.works)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works = []
        if self.metas is not None:
            for tensor, meta in zip(self.tensors, self.metas):
                tensor.requires_grad_(meta.requires_grad)
            self.metas = None
        return self.tensors


@dataclass
class SendsInFlight:
    """Started sends, with the tensors they read kept alive until each has completed."""

    pending: list[tuple[CheckedWork, list[torch.Tensor]]] = field(default_factory=list)

    def add(self, work: CheckedWork, tensors: list[torch.Tensor]) -> None:
        self.pending.append((work, tensors))
        if len(self.pending) > 64:  # drop the finished ones so buffers are freed early
            self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def exchange_nonblocking(
    transfers: list[Transfer],
    cache: dict[Hashable, list[TensorMeta]],
    device: torch.device,
    group: ProcessGroup | None,
    sends: SendsInFlight,
) -> list[PendingReceive | None]:
    """Start the sends (header first when new) and post the receives; nothing waits but a
    first-step header. Returns, per transfer, its :class:`PendingReceive` (None for sends).
    """
    out: list[PendingReceive | None] = []
    for transfer in transfers:
        if not transfer.send:
            continue
        assert transfer.tensors is not None
        tensors = [t.detach().contiguous() for t in transfer.tensors if t.numel()]
        if transfer.metas is None and transfer.key not in cache:
            cache[transfer.key] = TensorMeta.of(transfer.tensors)
            tensors.insert(0, _encode(transfer.tensors, transfer.key).to(device))
        for tensor in tensors:
            sends.add(collectives.isend(tensor, transfer.peer, group), [tensor])
    for transfer in transfers:
        if transfer.send:
            out.append(None)
            continue
        if transfer.metas is None and transfer.key not in cache:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
            collectives.irecv(header, transfer.peer, group).wait()
            cache[transfer.key] = _decode(header.cpu())
        metas = transfer.metas if transfer.metas is not None else cache[transfer.key]
        tensors = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
        works = [collectives.irecv(t, transfer.peer, group) for t in tensors if t.numel()]
        out.append(PendingReceive(tensors, works, None if transfer.metas is not None else metas))
    return out
