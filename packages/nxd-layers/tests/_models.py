"""Shared helpers of the attention, padding and tracing tests: the TP coordinates, error
checks, tolerances, the GQA attention models (an unsharded reference and its TP copy) and a
tiny Llama-style LM built from nxd's layers with its unsharded reference.

Not a test module (no ``test_`` prefix): test files load it by path
(``nxd_state.testing.load_sibling``), because the rank processes find functions by file and
pytest's importlib mode does not put this directory on ``sys.path``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    get_kv_size_multiplier,
)

# fp32 with torch's defaults: the same products, sums split over ranks (a few ulps).
FP32 = {"rtol": 1.3e-6, "atol": 1e-5}
# The attention block chains projection, RoPE, softmax and output projection with sums split
# differently over ranks, so rounding differences compound: values are O(1), still ~1000x
# below any real sharding error (which is O(1)).
BLOCK = {"rtol": 1e-5, "atol": 1e-5}
EXACT = {"rtol": 0.0, "atol": 0.0}  # copies of the same numbers
B, S = 2, 8


def tp_rank() -> tuple[int, int]:
    """(TP size, TP rank) of this process in the current parallel state."""
    return nxd_state.get_tensor_model_parallel_size(), nxd_state.get_tensor_model_parallel_rank()


def raises(fn: Callable[[], object], *fragments: str) -> None:
    """``fn()`` raises a ValueError whose message holds every fragment."""
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as info:
        fn()
    for fragment in fragments[1:]:
        assert fragment in str(info.value), (fragment, str(info.value))


# GQA QKV projection ------------------------------------------------------------------------
def kv_heads_of_rank(par: GQAQKVColumnParallelLinear, hd: int) -> list[int]:
    """Original KV head held in each local K/V slot: the head of the Q heads the slot serves
    under GQA grouping (Q head i uses KV head i // (n_heads / n_kv))."""
    tp, rank = tp_rank()
    n_heads, n_kv = par.output_sizes[0] // hd, par.output_sizes[1] // hd
    local_q, local_kv = n_heads // tp, par.kv_output_size_per_partition // hd
    per_slot = local_q // local_kv
    return [(rank * local_q + j * per_slot) // (n_heads // n_kv) for j in range(local_kv)]


def load_qkv(
    par: GQAQKVColumnParallelLinear, hd: int, q: nn.Linear, k: nn.Linear, v: nn.Linear
) -> None:
    """Slice the reference projections into ``par``: Q by rank; K/V slot j of this rank holds
    the KV head of the Q heads it serves (GQA grouping), derived here from the head counts."""
    tp, rank = tp_rank()
    n_kv = k.out_features // hd
    heads = kv_heads_of_rank(par, hd)
    for kind in ("weight", "bias"):
        if getattr(q, kind) is None:
            continue
        parts = [getattr(q, kind).chunk(tp, dim=0)[rank]]
        for ref in (k, v):
            full = getattr(ref, kind).reshape(n_kv, hd, -1)
            parts.append(full[heads].reshape(-1, *getattr(ref, kind).shape[1:]))
        with torch.no_grad():
            if par.fuse_qkv:
                getattr(par, f"{kind}_qkv").copy_(torch.cat(parts))
            else:
                for part, value in zip("qkv", parts):
                    getattr(par, f"{kind}_{part}").copy_(value)


# Llama-style attention -------------------------------------------------------------------
def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (B, nh, T, hd), positions 0..T-1."""
    hd, t = x.shape[-1], x.shape[-2]
    freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angle = torch.arange(t, dtype=torch.float32)[:, None] * freq[None, :]  # (T, hd/2)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
    return x * cos + half * sin


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hd: int, seq_first: bool
) -> torch.Tensor:
    """Causal GQA attention on projections (B, T, n*hd) or (T, B, n*hd); same layout out."""
    if seq_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    b, t = q.shape[:2]
    q, k, v = (x.reshape(b, t, -1, hd).transpose(1, 2) for x in (q, k, v))  # (B, nh, T, hd)
    q, k = rope(q), rope(k)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
    out = out.transpose(1, 2).reshape(b, t, -1)
    return out.transpose(0, 1) if seq_first else out


class RefAttention(nn.Module):
    """Pre-norm GQA attention with a residual, unsharded: x + O(attend(Q h, K h, V h))."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, hd: int) -> None:
        super().__init__()
        self.hd = hd
        self.q = nn.Linear(hidden, n_heads * hd, bias=False)
        self.k = nn.Linear(hidden, n_kv * hd, bias=False)
        self.v = nn.Linear(hidden, n_kv * hd, bias=False)
        self.o = nn.Linear(n_heads * hd, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, seq_first: bool = False) -> torch.Tensor:
        h = self.norm(x)
        return x + self.o(attend(self.q(h), self.k(h), self.v(h), self.hd, seq_first))


class ParallelAttention(nn.Module):
    """:class:`RefAttention` over TP: GQA QKV column-parallel, O row-parallel (``sp``: the
    input and output are this rank's sequence shard, ``[S/tp, B, H]``)."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, hd: int, sp: bool) -> None:
        super().__init__()
        tp, _ = tp_rank()
        self.hd, self.sp = hd, sp
        self.qkv = GQAQKVColumnParallelLinear(
            hidden,
            [n_heads * hd, n_kv * hd],
            bias=False,
            gather_output=False,
            sequence_parallel_enabled=sp,
            kv_size_multiplier=get_kv_size_multiplier(n_kv, tp),
            head_dim=hd,
        )
        self.o = RowParallelLinear(
            n_heads * hd, hidden, bias=False, input_is_parallel=True, sequence_parallel_enabled=sp
        )
        self.norm = nn.LayerNorm(hidden)
        if sp:  # the norm sees only this rank's sequence shard
            for p in self.norm.parameters():
                p.sequence_parallel_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(attend(*self.qkv(self.norm(x)), self.hd, self.sp))


def load_attention(par: ParallelAttention, ref: RefAttention) -> None:
    """Put ``ref``'s weights into ``par`` (this rank's slices)."""
    tp, rank = tp_rank()
    load_qkv(par.qkv, ref.hd, ref.q, ref.k, ref.v)
    with torch.no_grad():
        par.o.weight.copy_(ref.o.weight.chunk(tp, dim=1)[rank])
        par.norm.load_state_dict(ref.norm.state_dict())


# A tiny Llama-style LM ----------------------------------------------------------------------
class RefMLP(nn.Module):
    """Pre-norm SwiGLU MLP with a residual: x + W_d (silu(W_g h) * W_u h), h = RMSNorm(x)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ParallelMLP(nn.Module):
    """:class:`RefMLP` over TP: gate and up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate = ColumnParallelLinear(hidden, ffn, bias=False, gather_output=False)
        self.up = ColumnParallelLinear(hidden, ffn, bias=False, gather_output=False)
        self.down = RowParallelLinear(ffn, hidden, bias=False, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


LLAMA = {"vocab": 64, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 64}


class RefLlama(nn.Module):
    """Embedding -> GQA attention block -> SwiGLU MLP block -> RMSNorm -> LM head, unsharded."""

    def __init__(self) -> None:
        super().__init__()
        c = LLAMA
        self.embed = nn.Embedding(c["vocab"], c["hidden"])
        self.attn = RefAttention(c["hidden"], c["heads"], c["kv_heads"], c["head_dim"])
        self.mlp = RefMLP(c["hidden"], c["ffn"])
        self.norm = nn.RMSNorm(c["hidden"], eps=1e-6)
        self.head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mlp(self.attn(self.embed(ids)))))


class ParallelLlama(nn.Module):
    """:class:`RefLlama` built from nxd's layers: vocabulary-parallel embedding, GQA attention
    and MLP over TP, a column-parallel head gathering the logits."""

    def __init__(self) -> None:
        super().__init__()
        c = LLAMA
        self.embed = ParallelEmbedding(c["vocab"], c["hidden"])
        self.attn = ParallelAttention(c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], False)
        self.mlp = ParallelMLP(c["hidden"], c["ffn"])
        self.norm = nn.RMSNorm(c["hidden"], eps=1e-6)
        self.head = ColumnParallelLinear(c["hidden"], c["vocab"], bias=False, gather_output=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mlp(self.attn(self.embed(ids)))))


def reference_llama(seed: int = 1234) -> RefLlama:
    """The unsharded model every test compares with (the same on every process)."""
    torch.manual_seed(seed)
    return RefLlama().eval()


def parallel_llama(seed: int = 1234) -> ParallelLlama:
    """This rank's shard of :func:`reference_llama` (its weights sliced in)."""
    tp, rank = tp_rank()
    ref = reference_llama(seed)
    par = ParallelLlama().eval()
    load_attention(par.attn, ref.attn)
    with torch.no_grad():
        par.embed.weight.copy_(ref.embed.weight.chunk(tp, dim=0)[rank])
        par.mlp.norm.load_state_dict(ref.mlp.norm.state_dict())
        for name in ("gate", "up"):
            getattr(par.mlp, name).weight.copy_(getattr(ref.mlp, name).weight.chunk(tp)[rank])
        par.mlp.down.weight.copy_(ref.mlp.down.weight.chunk(tp, dim=1)[rank])
        par.norm.load_state_dict(ref.norm.state_dict())
        par.head.weight.copy_(ref.head.weight.chunk(tp)[rank])
    return par
