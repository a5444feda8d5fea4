"""Ring attention: exact attention over a sequence split across the context-parallel group.

Rank ``r`` of ``n`` holds queries, keys and values of its sequence slice. In ``n`` steps the K/V
blocks travel one hop around the ring (rank ``r`` sends to ``r + 1``, receives from ``r - 1``;
``batch_isend_irecv`` through :mod:`nxd_state.collectives`), the transfer of the next block
posted before this block is computed, so communication overlaps compute. Each step's block
output is merged by online softmax (:func:`~nxd_layers.context_parallel._blocks.merge`):

    lse = log(e^lse + e^lse_b),   O = e^(lse_old - lse) O + e^(lse_b - lse) O_b

which is exactly softmax over every key. Causal attention uses the zigzag split
(:mod:`~nxd_layers.context_parallel.split`: rank ``r`` holds chunks ``r`` and ``2n - 1 - r`` of
``2n``), so that at step ``s > 0``, with K/V from rank ``src = r - s mod n``:

* ``src < r``: both query chunks see the first K/V chunk, none of the second;
* ``src > r``: the second query chunk sees both K/V chunks, the first query chunk nothing;

half a block each way: every rank does the same work at every step. Step 0 is the local causal
block (the two chunks are in increasing global order, so the plain causal mask is exact).

Backward runs the ring again with the final ``O`` and ``lse``: each block's ``dK, dV`` are added
to a buffer that travels with the K/V it belongs to and, after ``n`` hops, reaches its owner.
Traffic per rank: forward ``(n - 1)`` K/V blocks, backward ``(n - 1)`` K/V blocks plus ``n``
dK/dV blocks. K/V move with their ``Hkv`` heads (grouped-query attention is never expanded on
the wire).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from nxd_layers.context_parallel._blocks import acc_dtype, block_backward, block_forward, merge
from nxd_state import collectives
from nxd_state.collectives import P2POp

__all__ = ["ring_attention"]


def _ring_peers(group: ProcessGroup) -> tuple[int, int, int, int]:
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def _start_shift(
    tensors: list[torch.Tensor], nxt: int, prv: int, group: ProcessGroup
) -> tuple[collectives.BatchWork, list[torch.Tensor]]:
    """Send ``tensors`` to the next rank and receive the previous rank's into new buffers."""
    received = [torch.empty_like(t) for t in tensors]
    ops = [P2POp("send", t.contiguous(), nxt, group) for t in tensors]
    ops += [P2POp("recv", r, prv, group) for r in received]
    return collectives.start_batch_send_recv(ops), received


def _step_slices(
    step: int, me: int, src: int, s_local: int, causal: bool
) -> tuple[slice, slice, bool]:
    """Which query rows and key columns of the local block take part at this step, and whether
    the step's block is causal (zigzag layout when ``causal``)."""
    full = slice(0, s_local)
    if not causal:
        return full, full, False
    if step == 0:
        return full, full, True
    half = s_local // 2
    if src < me:
        return full, slice(0, half), False
    return slice(half, s_local), full, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: ProcessGroup,
        causal: bool,
        scale: float,
        kernel: str,
    ) -> torch.Tensor:
        me, n, nxt, prv = _ring_peers(group)
        s_local = q.shape[2]
        acc = acc_dtype(q.dtype)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(n):
            work = None
            if step + 1 < n:  # overlap: the next block travels while this one is computed
                work, incoming = _start_shift(kv, nxt, prv, group)
            src = (me - step) % n
            rows, cols, block_causal = _step_slices(step, me, src, s_local, causal)
            o_b, lse_b = block_forward(
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                scale=scale,
                causal=block_causal,
                kernel=kernel,
            )
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            if work is not None:
                work.wait()
                kv = incoming
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.kernel = group, causal, scale, kernel
        return result

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, kernel = ctx.group, ctx.causal, ctx.scale, ctx.kernel
        me, n, nxt, prv = _ring_peers(group)
        s_local = q.shape[2]
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        dkv = [
            torch.zeros(k.shape, dtype=acc, device=k.device),
            torch.zeros(v.shape, dtype=acc, device=v.device),
        ]
        dout = dout.contiguous()
        for step in range(n):
            kv_work = None
            if step + 1 < n:
                kv_work, kv_next = _start_shift(kv, nxt, prv, group)
            src = (me - step) % n
            rows, cols, block_causal = _step_slices(step, me, src, s_local, causal)
            dq_b, dk_b, dv_b = block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                scale=scale,
                causal=block_causal,
                kernel=kernel,
            )
            dq[:, :, rows] += dq_b
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b
            # The dK/dV buffer follows its K/V one hop; after n hops it is home.
            dkv_work, dkv_next = _start_shift(dkv, nxt, prv, group) if n > 1 else (None, dkv)
            if kv_work is not None:
                kv_work.wait()
                kv = kv_next
            if dkv_work is not None:
                dkv_work.wait()
            dkv = dkv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Exact ``softmax(scale q k^T [+ causal mask]) v`` over the whole sequence, each rank of
    ``group`` holding its slice: ``q`` ``(B, Hq, S/n, D)``, ``k, v`` ``(B, Hkv, S/n, D)``
    (``Hq`` a multiple of ``Hkv``), split with
    :func:`~nxd_layers.context_parallel.split.split_for_context_parallel` (zigzag when
    ``causal``). Returns this rank's rows of the output, ``(B, Hq, S/n, D)``.
    ``scale`` defaults to ``1/sqrt(D)``; ``kernel`` as in
    :mod:`~nxd_layers.context_parallel._blocks`.
    """
    _check_qkv(q, k, v, causal)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _RingAttention.apply(q, k, v, group, causal, float(scale), kernel)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, heads, sequence, head_dim), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape[:-1] + k.shape[-1:] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"k and v must have the same batch, heads and sequence, and q the same local "
            f"sequence length: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )
    if causal and q.shape[2] % 2 != 0:
        raise ValueError(
            f"causal ring attention needs the zigzag split (two chunks per rank): the local "
            f"sequence length {q.shape[2]} must be even"
        )
