"""Every collective nxd issues, in one module, each on an explicit group.

The wrappers hide what backends lack and skip communication on groups of one. A missing native
op is detected once per backend (the backend refuses it before any byte moves) and emulated
from then on: reduce-scatter as an all-reduce and a slice (a backend with neither a
reduce-scatter nor an all-to-all), all-to-all as pairwise sends and receives (a backend without
``all_to_all_single``; gloo through torch 2.11 also lacks the list form ``all_to_all``, which
is why the tensor form is the one used). On gloo, where torch's reduce-scatter is an all-reduce
of a copy and its all-gather stages through a buffer of its own, :func:`reduce_scatter` is an
all-to-all and a local reduction, and :func:`all_gather` with ``out`` is n broadcasts in place.

An opt-in :class:`CollectiveCounter` records calls and bytes per op and per group, so
benchmarks can compare traffic with theory. Two byte counts are kept per call:

* ``bytes``: the payload, the size of the tensor handed to the op on this rank
  (for all-gather the local shard, for reduce-scatter the full input);
* ``wire_bytes``: what this rank sends under the bandwidth-optimal ring algorithm, with
  ``n`` ranks: all-reduce ``2(n-1)/n * B``, all-gather ``(n-1) * B_shard``, reduce-scatter
  and all-to-all ``(n-1)/n * B``, broadcast ``B`` on the source, send ``B``, recv ``0``.
  An emulated op is counted under the name asked for, with the traffic of what really ran:
  the all-reduce behind an emulated reduce-scatter sends ``2(n-1)/n * B``; the pairwise
  all-to-all sends ``(n-1)/n * B``, exactly the native volume; the in-place all-gather that
  runs as n broadcasts on gloo (see :func:`all_gather`) sends ``(n-1) * B_shard`` per rank,
  exactly the ring's.

Every op takes tensors on any device, whatever the group's backend: a tensor on a device the
backend cannot use (a CPU flag or loss sum on an NCCL group, a CPU tensor on an XLA group) is
*staged* by one helper, :func:`_staged` (rules in :mod:`nxd_state._staging`): copied to the
backend's device (gloo: CPU, which also takes CUDA tensors as they are; NCCL: the current CUDA
device; xla: this process's XLA device), the op runs on the copy, and the result is copied back
into the caller's tensor (in-place ops, receives, ``out``) or moved to the caller's device (ops
that return a new tensor). A staged op is counted in the traffic counter like any other: the
copies are local, not traffic.

A backend error in any of them (a peer died, raised, or never joined before the timeout) is
raised as :class:`nxd_state.health.RankFailureError` naming the rank(s) that caused it, the
backend's error chained (see :mod:`nxd_state.health`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from nxd_state._staging import backend_of, stage, staging_device, unstage
from nxd_state._traffic import (
    CollectiveCounter,
    OpStats,
    count_collectives,
    group_name,
    group_rank,
    group_size,
    nbytes,
    record,
    register_group_name,
)
from nxd_state.health import CheckedWork, checked, group_timeout

__all__ = [
    "BatchWork",
    "CollectiveCounter",
    "OpStats",
    "P2POp",
    "all_gather",
    "all_reduce",
    "all_reduce_bucketed",
    "all_to_all",
    "all_to_all_uneven",
    "barrier",
    "batch_send_recv",
    "broadcast",
    "count_collectives",
    "group_name",
    "group_rank",
    "group_size",
    "irecv",
    "isend",
    "new_group",
    "recv",
    "reduce_scatter",
    "register_group_name",
    "send",
    "start_batch_send_recv",
]

Group = ProcessGroup | None


def new_group(
    ranks: Sequence[int], name: str | None = None, backend: str | None = None
) -> ProcessGroup | None:
    """Create the process group of ``ranks`` (global ranks) on ``backend`` (default: the
    default group's), with nxd's group timeout (:func:`nxd_state.health.group_timeout`:
    torch's ``new_group`` does not inherit the default group's).

    Collective over the default group: every rank calls it with the same ranks in the same
    order, members or not. Returns ``None`` on a rank outside ``ranks`` (torch hands those a
    non-member marker, not a group); a member's group is ``name`` in traffic reports.
    """
    group = dist.new_group(list(ranks), timeout=group_timeout(), backend=backend)
    if not isinstance(group, ProcessGroup):  # GroupMember.NON_GROUP_MEMBER, an int
        return None
    if name is not None:
        register_group_name(group, name)
    return group


# Backends found to lack a native op (detected on first use): the op is emulated instead.
_NO_NATIVE_REDUCE_SCATTER: set[str] = set()  # gloo before torch 2.6
_NO_NATIVE_ALL_TO_ALL: set[str] = set()  # e.g. torch-xla's xla backend


def _backend_name(group: Group) -> str:
    return backend_of(group)


@contextlib.contextmanager
def _staged(
    group: Group, *tensors: torch.Tensor, inplace: bool = True
) -> Iterator[list[torch.Tensor]]:
    """``tensors`` as ``group``'s backend takes them: each one itself, or a staging copy on the
    backend's device (:mod:`nxd_state._staging`); with ``inplace``, when the block ends without
    an error every staging copy is copied back into its tensor."""
    staged = [stage(tensor, group) for tensor in tensors]
    yield staged
    if inplace:
        for tensor, copy in zip(tensors, staged):
            unstage(tensor, copy)


def _is_unsupported(error: Exception) -> bool:
    """Whether ``error`` is a backend refusing an op it does not implement (raised before any
    traffic, identically on every rank of the group), as opposed to a failure mid-transfer."""
    if isinstance(error, NotImplementedError):
        return True
    text = str(error).lower()
    return any(words in text for words in ("does not support", "not supported", "unsupported"))


# Collectives -----------------------------------------------------------------------------
@checked("all_reduce", 1)
def all_reduce(
    tensor: torch.Tensor, group: Group = None, op: ReduceOp.RedOpType = ReduceOp.SUM
) -> torch.Tensor:
    """``tensor <- op over ranks of tensor``, in place; returns ``tensor``."""
    n = group_size(group)
    if n == 1:
        return tensor
    record("all_reduce", group, nbytes(tensor), 2 * (n - 1) / n * nbytes(tensor))
    with _staged(group, tensor) as (work,):
        dist.all_reduce(work, op=op, group=group)
    return tensor


@checked("all_gather", 1)
def all_gather(
    tensor: torch.Tensor, group: Group = None, dim: int = 0, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``cat([x_0, ..., x_{n-1}], dim)``: every rank's shard, concatenated in rank order.

    ``out`` (``dim=0`` only): a contiguous tensor of shape ``(n * x.shape[0], *x.shape[1:])``
    that receives the result in place and is returned; chunk r of it is rank r's shard, so
    ``tensor`` may be this rank's chunk of ``out`` (then nothing is copied). On gloo this
    in-place form runs as n asynchronous broadcasts, the one from rank k filling chunk k:
    gloo's all-gather stages its result in a flat buffer of its own and copies it out, while a
    broadcast writes straight into ``out`` (torch's ``ZeroRedundancyOptimizer`` gathers its
    parameters the same way). It is counted as the all-gather it is: gloo's broadcast is a
    binomial tree, and over the n broadcasts every rank sends ``(n-1) * B_shard``, the ring
    all-gather's volume. Elsewhere, and while compiling or exporting, it is one
    ``all_gather_into_tensor`` into ``out``.
    """
    n = group_size(group)
    if out is not None:
        _check_gather_out(tensor, out, n, dim)
    if n == 1:
        if out is None:
            return tensor
        if out.data_ptr() != tensor.data_ptr():
            out.copy_(tensor)
        return out
    record("all_gather", group, nbytes(tensor), (n - 1) * nbytes(tensor))
    if out is not None:
        if staging_device(out, group) is None:  # out and the shard (same device) stay
            _all_gather_into(out, tensor, group, n)
            return out
        with _staged(group, out) as (staged_out,):
            _all_gather_into(staged_out, tensor.to(staged_out.device), group, n)
        return out
    dim = dim % tensor.dim()
    with _staged(group, tensor.movedim(dim, 0).contiguous(), inplace=False) as (moved,):
        gathered = torch.empty(
            (n * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=moved.device
        )
        dist.all_gather_into_tensor(gathered, moved, group=group)
    return gathered.to(tensor.device).movedim(0, dim)


def _check_gather_out(tensor: torch.Tensor, out: torch.Tensor, n: int, dim: int) -> None:
    """The in-place all-gather's contract, checked on every rank before any traffic."""
    if dim % max(tensor.dim(), 1) != 0:
        raise ValueError(f"all_gather(out=...) gathers along dim 0 only, got dim={dim}")
    expected = (n * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (n,)
    if tuple(out.shape) != expected:
        raise ValueError(
            f"all_gather: out has shape {tuple(out.shape)}, expected {expected} "
            f"({n} shards of shape {tuple(tensor.shape)})"
        )
    if out.dtype != tensor.dtype or out.device != tensor.device:
        raise ValueError(
            f"all_gather: out is {out.dtype} on {out.device}, the shard is {tensor.dtype} on "
            f"{tensor.device}; they must match"
        )
    if not out.is_contiguous():
        raise ValueError(f"all_gather: out must be contiguous (strides {out.stride()})")


def _all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group: Group, n: int) -> None:
    chunks = out.view(n, -1)
    if _backend_name(group) != "gloo" or torch.compiler.is_compiling():
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return
    mine = chunks[group_rank(group)]
    if mine.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        mine.copy_(tensor.reshape(-1))
    ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
    works = [dist.broadcast(chunks[k], src=ranks[k], group=group, async_op=True) for k in range(n)]
    for work in works:
        assert work is not None
        work.wait()


@checked("reduce_scatter", 1)
def reduce_scatter(
    tensor: torch.Tensor,
    group: Group = None,
    dim: int = 0,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
) -> torch.Tensor:
    """Y_r = chunk r of (op over ranks of X), X split into ``n`` equal chunks along ``dim``.

    On gloo, which has no reduce-scatter of its own (torch runs ``reduce_scatter_tensor`` there
    as an all-reduce of a copy, 2(n-1)/n·B on the wire), it is an all-to-all and a local
    reduction: rank r receives chunk r of every rank's X, (n-1)/n·B sent per rank, the
    reduce-scatter's own volume, and reduces the n chunks in rank order (sum, product, min,
    max; other ops, and compiled or exported code, use ``reduce_scatter_tensor``).
    """
    n = group_size(group)
    if n == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.shape[dim] % n != 0:
        raise ValueError(
            f"reduce_scatter: size {tensor.shape[dim]} of dim {dim} is not divisible by the "
            f"group size {n}"
        )
    payload = nbytes(tensor)
    with _staged(group, tensor.movedim(dim, 0).contiguous(), inplace=False) as (moved,):
        out = _reduce_scatter_rows(moved, group, n, op, payload)
    return out.to(tensor.device).movedim(0, dim)


def _reduce_scatter_rows(
    moved: torch.Tensor, group: Group, n: int, op: ReduceOp.RedOpType, payload: int
) -> torch.Tensor:
    """Chunk r of (op over ranks of ``moved``) along dim 0, on ``moved``'s device."""
    backend = _backend_name(group)
    local = _LOCAL_REDUCTIONS.get(op)
    if (
        backend == "gloo"
        and local is not None
        and backend not in _NO_NATIVE_ALL_TO_ALL
        and not torch.compiler.is_compiling()
    ):
        received = torch.empty_like(moved)  # rows [j·m, (j+1)·m): chunk r of rank j's X
        dist.all_to_all_single(received, moved, group=group)
        record("reduce_scatter", group, payload, (n - 1) / n * payload)
        return local(received.view(n, moved.shape[0] // n, *moved.shape[1:]))
    if backend not in _NO_NATIVE_REDUCE_SCATTER:
        out = torch.empty(
            (moved.shape[0] // n, *moved.shape[1:]), dtype=moved.dtype, device=moved.device
        )
        try:
            dist.reduce_scatter_tensor(out, moved, op=op, group=group)
        except RuntimeError as error:  # older gloo: no reduce-scatter; raised before any traffic
            if not _is_unsupported(error):
                raise
            _NO_NATIVE_REDUCE_SCATTER.add(backend)
        else:
            # torch's gloo runs it as an all-reduce of a copy: count what went on the wire
            ring = 2 * (n - 1) / n if backend == "gloo" else (n - 1) / n
            record("reduce_scatter", group, payload, ring * payload)
            return out
    # Emulation: an all-reduce (what goes on the wire, and what is counted) and a slice.
    record("reduce_scatter", group, payload, 2 * (n - 1) / n * payload)
    reduced = moved.clone()
    dist.all_reduce(reduced, op=op, group=group)
    return reduced.chunk(n, dim=0)[group_rank(group)].contiguous()


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    out = rows[0].clone()
    for row in rows[1:]:
        out.add_(row)
    return out


def _prod_rows(rows: torch.Tensor) -> torch.Tensor:
    out = rows[0].clone()
    for row in rows[1:]:
        out.mul_(row)
    return out


# Local reductions over dim 0 (one row per source rank, combined in rank order).
_LOCAL_REDUCTIONS = {
    ReduceOp.SUM: _sum_rows,
    ReduceOp.PRODUCT: _prod_rows,
    ReduceOp.MIN: lambda rows: rows.amin(dim=0),
    ReduceOp.MAX: lambda rows: rows.amax(dim=0),
}


@checked("all_to_all", 1)
def all_to_all(
    tensor: torch.Tensor, group: Group = None, scatter_dim: int = 0, gather_dim: int = 0
) -> torch.Tensor:
    """Y_r = cat_j(chunk r of X_j): split along ``scatter_dim``, concat along ``gather_dim``."""
    n = group_size(group)
    if n == 1:
        return tensor
    scatter_dim %= tensor.dim()
    gather_dim %= tensor.dim()
    if tensor.shape[scatter_dim] % n != 0:
        raise ValueError(
            f"all_to_all: size {tensor.shape[scatter_dim]} of scatter dim {scatter_dim} is not "
            f"divisible by the group size {n}"
        )
    payload = nbytes(tensor)
    # (n, *chunk): row j is what this rank sends to group rank j, and receives from it.
    if scatter_dim == 0 and tensor.is_contiguous():  # the chunks already lie row by row
        rows = tensor.view(n, tensor.shape[0] // n, *tensor.shape[1:])
    else:
        rows = torch.stack(tensor.chunk(n, dim=scatter_dim))
    with _staged(group, rows, inplace=False) as (send,):
        received = _all_to_all_rows(send, group, payload)
    return _concat_rows(received.to(tensor.device), gather_dim)


@checked("all_to_all", 1)
def all_to_all_uneven(
    tensor: torch.Tensor,
    group: Group = None,
    *,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
) -> torch.Tensor:
    """All-to-all of uneven row blocks along dim 0 (``all_to_all_v``).

    ``tensor`` is ``cat(X_0, ..., X_{n-1})`` with ``X_j`` (``send_counts[j]`` rows) for group
    rank ``j``; the result is ``cat(Y_0, ..., Y_{n-1})`` with ``Y_j`` (``recv_counts[j]``
    rows) the block rank ``j`` sent here. Counts must agree between ranks (rank ``i``'s
    ``send_counts[j]`` is rank ``j``'s ``recv_counts[i]``), as the MoE dispatch ensures by
    exchanging them first. Counted as ``all_to_all``: payload ``B``, wire bytes what leaves
    this rank (the rows sent to other ranks).
    """
    n = group_size(group)
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send_counts) != n or len(recv_counts) != n:
        raise ValueError(
            f"all_to_all_uneven: {len(send_counts)} send counts and {len(recv_counts)} receive "
            f"counts for a group of {n} ranks (one count per rank expected)"
        )
    if sum(send_counts) != tensor.shape[0]:
        raise ValueError(
            f"all_to_all_uneven: send counts sum to {sum(send_counts)} but the tensor has "
            f"{tensor.shape[0]} rows"
        )
    if n == 1:
        return tensor
    row = nbytes(tensor) // max(tensor.shape[0], 1)
    me = group_rank(group)
    record("all_to_all", group, nbytes(tensor), row * (sum(send_counts) - send_counts[me]))
    with _staged(group, tensor.contiguous(), inplace=False) as (send,):
        received = send.new_empty((sum(recv_counts), *send.shape[1:]))
        backend = _backend_name(group)
        if backend not in _NO_NATIVE_ALL_TO_ALL:
            try:
                dist.all_to_all_single(
                    received,
                    send,
                    output_split_sizes=recv_counts,
                    input_split_sizes=send_counts,
                    group=group,
                )
            except RuntimeError as error:  # raised by the backend before any traffic
                if not _is_unsupported(error):
                    raise
                _NO_NATIVE_ALL_TO_ALL.add(backend)
            else:
                return received.to(tensor.device)
        _all_to_all_uneven_pairwise(received, send, group, send_counts, recv_counts)
    return received.to(tensor.device)


def _all_to_all_uneven_pairwise(
    received: torch.Tensor,
    send: torch.Tensor,
    group: Group,
    send_counts: list[int],
    recv_counts: list[int],
) -> None:
    """:func:`all_to_all_uneven` as one send and one receive per peer (empty blocks skipped)."""
    me = group_rank(group)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
    sends, recvs = send.split(send_counts), received.split(recv_counts)
    recvs[me].copy_(sends[me])
    ops = []
    for peer, peer_rank in enumerate(ranks):
        if peer == me:
            continue
        if send_counts[peer]:
            ops.append(dist.P2POp(dist.isend, sends[peer].contiguous(), peer_rank, group))
        if recv_counts[peer]:
            ops.append(dist.P2POp(dist.irecv, recvs[peer], peer_rank, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _all_to_all_rows(send: torch.Tensor, group: Group, payload: int) -> torch.Tensor:
    """received[j] <- row ``rank`` of group rank j's ``send``, on ``send``'s device."""
    n = send.shape[0]
    received = torch.empty_like(send)
    backend = _backend_name(group)
    if backend not in _NO_NATIVE_ALL_TO_ALL:
        try:
            dist.all_to_all_single(received, send, group=group)
        except RuntimeError as error:  # raised by the backend before any traffic
            if not _is_unsupported(error):
                raise
            _NO_NATIVE_ALL_TO_ALL.add(backend)
        else:
            record("all_to_all", group, payload, (n - 1) / n * payload)
            return received
    record("all_to_all", group, payload, (n - 1) / n * payload)
    _all_to_all_pairwise(received, send, group)
    return received


def _concat_rows(received: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """cat(received[0], …, received[n-1]) along ``gather_dim`` (a view when it is dim 0)."""
    if gather_dim == 0:
        return received.view(-1, *received.shape[2:])
    return torch.cat(received.unbind(0), dim=gather_dim)


def _all_to_all_pairwise(received: torch.Tensor, send: torch.Tensor, group: Group) -> None:
    """received[j] <- send[rank] of group rank j: n - 1 sends and receives, one per peer, posted
    together (the wire volume of a native all-to-all); this rank's own row is a local copy."""
    me = group_rank(group)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
    received[me].copy_(send[me])
    ops = []
    for peer, peer_rank in enumerate(ranks):
        if peer != me:
            ops.append(dist.P2POp(dist.isend, send[peer], peer_rank, group))
            ops.append(dist.P2POp(dist.irecv, received[peer], peer_rank, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


@checked("broadcast", 2)
def broadcast(tensor: torch.Tensor, src: int, group: Group = None) -> torch.Tensor:
    """Every rank's ``tensor <- tensor`` of global rank ``src``, in place; returns ``tensor``."""
    n = group_size(group)
    if n == 1:
        return tensor
    wire = nbytes(tensor) if dist.get_rank() == src else 0
    record("broadcast", group, nbytes(tensor), wire)
    with _staged(group, tensor) as (work,):
        dist.broadcast(work, src=src, group=group)
    return tensor


@checked("send", 2)
def send(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    """Blocking send to global rank ``dst``."""
    record("send", group, nbytes(tensor), nbytes(tensor))
    with _staged(group, tensor.contiguous(), inplace=False) as (work,):
        dist.send(work, dst=dst, group=group)


@checked("recv", 2)
def recv(tensor: torch.Tensor, src: int, group: Group = None) -> torch.Tensor:
    """Blocking receive from global rank ``src`` into ``tensor``; returns it."""
    record("recv", group, nbytes(tensor), 0)
    buffer = stage(tensor, group, copy_data=False)
    dist.recv(buffer, src=src, group=group)
    return unstage(tensor, buffer)


@checked("isend", 2)  # posting can fail too (a peer already gone), not only wait()
def isend(tensor: torch.Tensor, dst: int, group: Group = None) -> CheckedWork:
    """Start sending contiguous ``tensor`` to global rank ``dst``; ``wait()`` the returned work
    before modifying or freeing it.

    On gloo the send progresses in gloo's own threads while the caller computes. Backends that
    order a communicator's operations on one stream (NCCL) can deadlock when two ranks each
    start a send before their receive: batch crossing transfers with :func:`batch_send_recv`.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"isend needs a contiguous tensor (shape {tuple(tensor.shape)})")
    record("send", group, nbytes(tensor), nbytes(tensor))
    staged = stage(tensor, group)
    work = dist.isend(staged, dst=dst, group=group)
    assert work is not None
    return CheckedWork(work, "isend", group, keep=staged)


@checked("irecv", 2)
def irecv(tensor: torch.Tensor, src: int, group: Group = None) -> CheckedWork:
    """Start receiving from global rank ``src`` into ``tensor``; valid after ``wait()``.

    Receives posted on one link complete in posting order, matched to the peer's sends in
    theirs.
    """
    record("recv", group, nbytes(tensor), 0)
    buffer = stage(tensor, group, copy_data=False)
    work = dist.irecv(buffer, src=src, group=group)
    assert work is not None
    if buffer is tensor:
        return CheckedWork(work, "irecv", group)
    return CheckedWork(work, "irecv", group, keep=buffer, then=lambda: unstage(tensor, buffer))


def _buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors, each at most ``cap_bytes`` (a single
    larger tensor gets a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and (
            tensor.dtype != current[0].dtype
            or tensor.device != current[0].device
            or size + nbytes > cap_bytes
        ):
            buckets.append(current)
            current, size = [], 0
        current.append(tensor)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@checked("all_reduce_bucketed", 1)
def all_reduce_bucketed(
    tensors: Sequence[torch.Tensor],
    group: Group,
    *,
    average: bool,
    bucket_cap_bytes: int = 25 * 2**20,
) -> None:
    """t_i <- Σ_r t_i^(r) (or the mean with ``average``) over ``group``, in place.

    The tensors are packed into flat buckets of at most ``bucket_cap_bytes`` (consecutive
    tensors of one dtype and device), so many small tensors cost few collectives.
    """
    size = group_size(group)
    if size == 1 or not tensors:
        return
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
    for bucket in _buckets(tensors, bucket_cap_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        all_reduce(flat, group=group)
        if average:
            flat.div_(size)
        start = 0
        for tensor in bucket:
            tensor.copy_(flat[start : start + tensor.numel()].view_as(tensor))
            start += tensor.numel()


@dataclass(frozen=True)
class P2POp:
    """One point-to-point transfer for :func:`batch_send_recv`: ``kind`` is "send" or "recv"."""

    kind: str
    tensor: torch.Tensor
    peer: int
    group: Group = None


@checked("batch_send_recv", None)
def batch_send_recv(ops: Sequence[P2POp]) -> None:
    """Issue sends and receives together and wait for all of them (no ordering deadlock)."""
    start_batch_send_recv(ops).wait()


class BatchWork:
    """The transfers of :func:`start_batch_send_recv`; ``wait()`` finishes all of them (a
    dead peer named as by the blocking ops) and fills the receiving tensors."""

    def __init__(self, works: list[CheckedWork]) -> None:
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()


@checked("start_batch_send_recv", None)
def start_batch_send_recv(ops: Sequence[P2POp]) -> BatchWork:
    """Post sends and receives together (``batch_isend_irecv``: no ordering deadlock) and return
    at once, so the caller computes while they progress; read the receiving tensors, and
    modify the sent ones, only after ``wait()``."""
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2POp.kind must be 'send' or 'recv', got {op.kind!r}")
    if not ops:
        return BatchWork([])
    p2p: list[dist.P2POp] = []
    after: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for op in ops:
        if op.kind == "send":
            record("send", op.group, nbytes(op.tensor), nbytes(op.tensor))
            staged = stage(op.tensor.contiguous(), op.group)
            p2p.append(dist.P2POp(dist.isend, staged, op.peer, op.group))
            after.append((staged, None))
        else:
            record("recv", op.group, nbytes(op.tensor), 0)
            buffer = stage(op.tensor, op.group, copy_data=False)
            p2p.append(dist.P2POp(dist.irecv, buffer, op.peer, op.group))
            after.append((buffer, op.tensor))
    works = []
    for work, op, (buffer, target) in zip(dist.batch_isend_irecv(p2p), ops, after):
        if target is None or buffer is target:
            works.append(CheckedWork(work, f"batch {op.kind}", op.group, keep=buffer))
        else:
            works.append(
                CheckedWork(
                    work,
                    f"batch {op.kind}",
                    op.group,
                    keep=buffer,
                    then=functools.partial(unstage, target, buffer),
                )
            )
    return BatchWork(works)


@checked("barrier", 0)
def barrier(group: Group = None) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)
