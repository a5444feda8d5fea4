"""One attention block with its log-sum-exp, and the block's exact backward.

For queries ``q`` (``B, Hq, S, D``) and keys/values ``k, v`` (``B, Hkv, T, D``) with
``Hq = g * Hkv`` (query head ``h`` reads key/value head ``h // g``, as SDPA's ``enable_gqa``):

    s_ij = scale * q_i . k_j,    lse_i = log sum_j exp(s_ij),    o_i = sum_j exp(s_ij - lse_i) v_j

(``j <= i`` only when ``causal``; ``S == T`` then). Given the *final* ``lse`` and output ``O``
of a row over every block (merged by :func:`merge`) and ``dO``, one block's share of the
gradient is exact (the flash-attention backward):

    p_ij = exp(s_ij - lse_i),  D_i = dO_i . O_i,  ds_ij = p_ij (dO_i . v_j - D_i)
    dq_i += scale * sum_j ds_ij k_j,   dk_j += scale * sum_i ds_ij q_i,   dv_j += sum_i p_ij dO_i

Kernels: ``"math"`` (the formulas above, any device; softmax statistics in fp32, fp64 for fp64
inputs; it materializes one block's scores, ``(S/n)^2`` per head, never the whole sequence's)
and ``"flash_cpu"`` (torch's SDPA kernel ``aten._scaled_dot_product_flash_attention_for_cpu``,
which returns the ``lse``, and its backward, which takes the final ``out``/``lse``). The kernel
gets K/V repeated to ``Hq`` heads locally (what it accepts); their gradients are summed back
over the ``g`` query heads of each K/V head. ``"auto"`` picks ``flash_cpu`` on CPU and
``math`` elsewhere: CUDA's flash/efficient SDPA kernels also return the ``lse``, but their
use here has not been verified on a GPU yet.
"""

from __future__ import annotations

import torch

__all__ = ["KERNELS", "block_backward", "block_forward", "merge", "resolve_kernel"]

KERNELS = ("auto", "math", "flash_cpu")


def resolve_kernel(kernel: str, q: torch.Tensor) -> str:
    """The kernel ``kernel`` means for ``q``'s device; a clear error for an unknown name."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel != "auto":
        return kernel
    return "flash_cpu" if q.device.type == "cpu" else "math"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where softmax statistics and merged outputs accumulate: float64 for float64 inputs,
    float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) (grouped-query "
            f"attention: each K/V head serves Hq / Hkv query heads)"
        )
    return hq // hkv


def _repeat(x: torch.Tensor, g: int) -> torch.Tensor:
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _fold(dx: torch.Tensor, g: int) -> torch.Tensor:
    """Sum a gradient over repeated heads back to ``Hkv`` heads."""
    if g == 1:
        return dx
    b, h, t, d = dx.shape
    return dx.view(b, h // g, g, t, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``(B, Hkv, g, S, T)`` scores (accumulation dtype), ``-inf`` above the diagonal when
    causal."""
    g = _groups(q, k)
    b, hq, s, d = q.shape
    acc = acc_dtype(q.dtype)
    qg = q.to(acc).view(b, hq // g, g, s, d)
    scores = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        t = k.shape[2]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of one block in the accumulation dtype: ``o`` ``(B, Hq, S, D)``, ``lse``
    ``(B, Hq, S)``."""
    kernel = resolve_kernel(kernel, q)
    g = _groups(q, k)
    if kernel == "math":
        scores = _scores(q, k, scale, causal)
        lse = scores.logsumexp(dim=-1)
        p = torch.exp(scores - lse.unsqueeze(-1))
        b, hq, s, _ = q.shape
        out = torch.matmul(p, v.to(p.dtype).unsqueeze(2)).reshape(b, hq, s, v.shape[-1])
        return out, lse.reshape(b, hq, s)
    kr, vr = _repeat(k, g), _repeat(v, g)
    if q.device.type != "cpu":
        raise ValueError(f"the flash_cpu kernel runs on CPU tensors, got {q.device}")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, kr, vr, 0.0, causal, scale=scale
    )
    acc = acc_dtype(q.dtype)
    return out.to(acc), lse.to(acc)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block (accumulation dtype), given the rows' *final* ``out`` and
    ``lse``."""
    kernel = resolve_kernel(kernel, q)
    g = _groups(q, k)
    if kernel == "math":
        b, hq, s, d = q.shape
        hkv, t = k.shape[1], k.shape[2]
        scores = _scores(q, k, scale, causal)
        acc = scores.dtype
        p = torch.exp(scores - lse.to(acc).view(b, hkv, g, s, 1))
        do = dout.to(acc).view(b, hkv, g, s, -1)
        o = out.to(acc).view(b, hkv, g, s, -1)
        dv = torch.matmul(p.transpose(-1, -2), do).sum(dim=2)
        dp = torch.matmul(do, v.to(acc).unsqueeze(2).transpose(-1, -2))
        ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
        dq = torch.matmul(ds, k.to(acc).unsqueeze(2)).reshape(b, hq, s, d) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).view(b, hkv, g, s, d)).sum(2) * scale
        return dq, dk.reshape(b, hkv, t, d), dv
    kr, vr = _repeat(k, g), _repeat(v, g)
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    dout, out = dout.to(dtype).contiguous(), out.to(dtype).contiguous()
    lse = lse.to(acc).contiguous()
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, kr, vr, out, lse, 0.0, causal, scale=scale
    )
    return dq.to(acc), _fold(dk.to(acc), g), _fold(dv.to(acc), g)


def merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: ``lse' = log(e^lse + e^lse_b)``,
    ``out' = e^(lse - lse') out + e^(lse_b - lse') out_b`` (first block: itself)."""
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    merged = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(
        block_lse - new
    ).unsqueeze(-1)
    return merged, new
