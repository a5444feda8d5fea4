"""The GQA QKV projection, a Llama-style GQA attention block and pad_model, each against the
same unsharded model in one process, on 2 and 4 gloo ranks.

Every rank builds the reference from the same seed and loads its weights into the parallel
copy by slicing (K/V heads picked by the GQA grouping rule, independently of the layer's own
replication code); outputs, input gradients and every gradient are compared, and the gradient
norm / clipping against ``torch.nn.utils.clip_grad_norm_`` on the reference.

Tolerance: fp32, torch's defaults (rtol=1.3e-6, atol=1e-5) for the projections (same
products, sums split over ranks: a few ulps). The attention block chains projection, RoPE,
softmax and output projection with sums split differently over ranks, so rounding
differences compound: rtol=1e-5, atol=1e-5 (values are O(1); still ~1000x below any
real sharding error, which is O(1)).
"""

from __future__ import annotations

import math
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
    RowParallelLinear,
    allreduce_sequence_parallel_gradients,
    clip_grad_norm,
    divide,
    full_tensor,
    get_kv_size_multiplier,
    get_number_of_extra_heads,
    pad_model,
)
from nxd_state.testing import run_distributed, run_named_checks

FP32 = {"rtol": 1.3e-6, "atol": 1e-5}  # see the module docstring
BLOCK = {"rtol": 1e-5, "atol": 1e-5}  # attention block, see the module docstring
EXACT = {"rtol": 0.0, "atol": 0.0}  # copies of the same numbers
B, S = 2, 8


def _tp() -> tuple[int, int]:
    return nxd_state.get_tensor_model_parallel_size(), nxd_state.get_tensor_model_parallel_rank()


def _raises(fn: Callable[[], object], *fragments: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as info:
        fn()
    for fragment in fragments[1:]:
        assert fragment in str(info.value), (fragment, str(info.value))


# GQA QKV projection ------------------------------------------------------------------------
def _kv_heads_of_rank(par: GQAQKVColumnParallelLinear, hd: int) -> list[int]:
    """Original KV head held in each local K/V slot: the head of the Q heads the slot serves
    under GQA grouping (Q head i uses KV head i // (n_heads / n_kv))."""
    tp, rank = _tp()
    n_heads, n_kv = par.output_sizes[0] // hd, par.output_sizes[1] // hd
    local_q, local_kv = n_heads // tp, par.kv_output_size_per_partition // hd
    per_slot = local_q // local_kv
    return [(rank * local_q + j * per_slot) // (n_heads // n_kv) for j in range(local_kv)]


def _load_qkv(
    par: GQAQKVColumnParallelLinear, hd: int, q: nn.Linear, k: nn.Linear, v: nn.Linear
) -> None:
    """Slice the reference projections into ``par``: Q by rank; K/V slot j of this rank holds
    the KV head of the Q heads it serves (GQA grouping), derived here from the head counts."""
    tp, rank = _tp()
    n_kv = k.out_features // hd
    heads = _kv_heads_of_rank(par, hd)
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


def check_qkv_gather(n_heads: int, n_kv: int, hd: int, fuse: bool, with_head_dim: bool) -> None:
    """gather_output=True: (Q, K, V) equal three nn.Linear; all gradients match."""
    tp, _ = _tp()
    hidden = 16
    mult = get_kv_size_multiplier(n_kv, tp)
    refs = [nn.Linear(hidden, n * hd) for n in (n_heads, n_kv, n_kv)]
    par = GQAQKVColumnParallelLinear(
        hidden,
        [n_heads * hd, n_kv * hd],
        kv_size_multiplier=mult,
        fuse_qkv=fuse,
        head_dim=hd if with_head_dim else None,
        keep_master_weight=True,
    )
    # The layer's own initialisation: this rank's slices of the seed-drawn master weights,
    # kept unreplicated as NxD keeps them (concatenated into master_weight_qkv when fused).
    if fuse:
        assert par.master_weight_q is None
        fused = par.master_weight_qkv
        assert fused.shape == ((n_heads + 2 * n_kv) * hd, hidden)
        split = fused.split([n_heads * hd, n_kv * hd, n_kv * hd])
        masters = {f"weight_{p}": w for p, w in zip("qkv", split)}
        bias_q = par.master_bias_qkv[: n_heads * hd].chunk(_tp()[0])[_tp()[1]]
        torch.testing.assert_close(par._parts("bias")[0], bias_q, rtol=0, atol=0)
    else:
        assert par.master_weight_qkv is None
        masters = {f"weight_{p}": getattr(par, f"master_weight_{p}") for p in "qkv"}
        assert masters["weight_k"].shape == (n_kv * hd, hidden)  # not replicated
        assert par.master_bias_k.shape == (n_kv * hd,)
    local = dict(zip("qkv", par._parts("weight")))
    torch.testing.assert_close(local["q"], masters["weight_q"].chunk(tp)[_tp()[1]], rtol=0, atol=0)
    for part in "kv":
        heads = masters[f"weight_{part}"].reshape(n_kv, hd, hidden)[_kv_heads_of_rank(par, hd)]
        torch.testing.assert_close(local[part], heads.reshape(-1, hidden), rtol=0, atol=0)
    _load_qkv(par, hd, *refs)
    x = torch.randn(B, S, hidden)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    gs = [torch.randn(B, S, r.out_features) for r in refs]
    outs_ref = [r(x_ref) for r in refs]
    outs_par = par(x_par)
    sum((o * g).sum() for o, g in zip(outs_ref, gs)).backward()
    sum((o * g).sum() for o, g in zip(outs_par, gs)).backward()
    for o_par, o_ref in zip(outs_par, outs_ref):
        torch.testing.assert_close(o_par, o_ref, **FP32)
    torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
    # Each parameter's gradient equals the reference gradient of the rows it holds (replicas
    # included: each received the sum over the replicas, i.e. the unsharded gradient).
    expected = _new_ref_grads_like(par, hd, refs)
    for name, grad in expected.items():
        torch.testing.assert_close(getattr(par, name).grad, grad, **FP32, msg=name)
    # The norm counts each K/V element once although it is held `mult` times.
    torch.testing.assert_close(
        clip_grad_norm(par.parameters(), 1e9),
        torch.nn.utils.clip_grad_norm_([p for r in refs for p in r.parameters()], 1e9),
        **FP32,
    )


def _new_ref_grads_like(par: GQAQKVColumnParallelLinear, hd: int, refs: list[nn.Linear]) -> dict:
    """The reference gradients laid out as ``par`` holds its parameters on this rank."""
    probe = [nn.Linear(r.in_features, r.out_features) for r in refs]
    with torch.no_grad():
        for p, r in zip(probe, refs):
            p.weight.copy_(r.weight.grad)
            p.bias.copy_(r.bias.grad)
    holder = GQAQKVColumnParallelLinear(
        par.input_size,
        par.output_sizes,
        kv_size_multiplier=par.kv_size_multiplier,
        fuse_qkv=par.fuse_qkv,
        head_dim=hd,
    )
    _load_qkv(holder, hd, *probe)
    return {name: p.detach() for name, p in holder.named_parameters()}


def check_qkv_errors() -> None:
    tp, _ = _tp()
    if tp < 2:
        return
    # 3 heads of 4 over TP: the heads do not divide; the message points to pad_model.
    _raises(lambda: GQAQKVColumnParallelLinear(16, [3 * 4, 3 * 4], head_dim=4), "pad_model")
    _raises(
        lambda: GQAQKVColumnParallelLinear(16, [8 * tp, 8 * tp - 4], head_dim=4),
        "num_heads",
    )
    _raises(
        lambda: GQAQKVColumnParallelLinear(16, [4 * 8, 4 * 1], head_dim=4, kv_size_multiplier=1),
        "num_kv_heads(1) x kv_size_multiplier(1) = 1",
        f"smallest valid multiplier is {tp}",
    )
    _raises(lambda: GQAQKVColumnParallelLinear(16, [32, 5]), "kv_size(5)", "kv_size_multiplier")
    _raises(
        lambda: GQAQKVColumnParallelLinear(16, [32, 8], kv_size_multiplier=0), "kv_size_multiplier"
    )
    sp = GQAQKVColumnParallelLinear(16, [8 * tp, 8 * tp], sequence_parallel_enabled=True)
    _raises(lambda: sp(torch.randn(S, 16)), "3-D input")


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
    def __init__(self, hidden: int, n_heads: int, n_kv: int, hd: int, sp: bool) -> None:
        super().__init__()
        tp, _ = _tp()
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


def check_attention_block(sequence_parallel: bool) -> None:
    """GQA block: 8 Q heads, 2 KV heads (TP=4 replicates each KV head twice)."""
    tp, rank = _tp()
    hidden, n_heads, n_kv, hd = 32, 8, 2, 4
    ref = RefAttention(hidden, n_heads, n_kv, hd)
    par = ParallelAttention(hidden, n_heads, n_kv, hd, sequence_parallel)
    _load_qkv(par.qkv, hd, ref.q, ref.k, ref.v)
    with torch.no_grad():
        par.o.weight.copy_(ref.o.weight.chunk(tp, dim=1)[rank])
        par.norm.load_state_dict(ref.norm.state_dict())
    x = torch.randn(S, B, hidden) if sequence_parallel else torch.randn(B, S, hidden)
    g = torch.randn_like(x)
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref, seq_first=sequence_parallel)
    (out_ref * g).sum().backward()
    if sequence_parallel:
        x_par = x.chunk(tp, dim=0)[rank].clone().requires_grad_()
        out_par = par(x_par)
        (out_par * g.chunk(tp, dim=0)[rank]).sum().backward()
        allreduce_sequence_parallel_gradients(par.parameters())
        torch.testing.assert_close(out_par, out_ref.chunk(tp, dim=0)[rank], **BLOCK)
        torch.testing.assert_close(x_par.grad, x_ref.grad.chunk(tp, dim=0)[rank], **BLOCK)
    else:
        x_par = x.clone().requires_grad_()
        out_par = par(x_par)
        (out_par * g).sum().backward()
        torch.testing.assert_close(out_par, out_ref, **BLOCK)
        torch.testing.assert_close(x_par.grad, x_ref.grad, **BLOCK)
    torch.testing.assert_close(
        full_tensor(par.o.weight, par.o.weight.grad), ref.o.weight.grad, **BLOCK
    )
    torch.testing.assert_close(par.norm.weight.grad, ref.norm.weight.grad, **BLOCK)
    torch.testing.assert_close(par.norm.bias.grad, ref.norm.bias.grad, **BLOCK)
    probe = RefAttention(hidden, n_heads, n_kv, hd)
    holder = ParallelAttention(hidden, n_heads, n_kv, hd, sequence_parallel)
    with torch.no_grad():
        for name, p in probe.named_parameters():
            p.copy_(dict(ref.named_parameters())[name].grad)
    _load_qkv(holder.qkv, hd, probe.q, probe.k, probe.v)
    for name in ("weight_q", "weight_k", "weight_v"):
        torch.testing.assert_close(
            getattr(par.qkv, name).grad, getattr(holder.qkv, name).detach(), **BLOCK, msg=name
        )
    # Clipping: the same norm and the same clipped gradients as torch on the reference.
    for norm_type in (2.0, math.inf):
        ref_grads = [p.grad.clone() for p in ref.parameters()]
        par_grads = [p.grad.clone() for p in par.parameters()]
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type=norm_type)
        norm_par = clip_grad_norm(par.parameters(), 0.5, norm_type=norm_type)
        torch.testing.assert_close(norm_par, norm_ref, **BLOCK)
        assert norm_ref > 0.5  # so clipping really happened
        torch.testing.assert_close(par.norm.weight.grad, ref.norm.weight.grad, **BLOCK)
        torch.testing.assert_close(
            full_tensor(par.o.weight, par.o.weight.grad), ref.o.weight.grad, **BLOCK
        )
        for p, grad in zip(ref.parameters(), ref_grads):
            p.grad.copy_(grad)
        for p, grad in zip(par.parameters(), par_grads):
            p.grad.copy_(grad)


# pad_model -------------------------------------------------------------------------------
class PaddableAttention(nn.Module):
    """Multi-head attention written for pad_model: local heads from the padded count."""

    def __init__(self, hidden: int, n_heads: int, hd: int) -> None:
        super().__init__()
        tp, _ = _tp()
        self.hd = hd
        self.n_heads_local = divide(n_heads + get_number_of_extra_heads(n_heads, tp), tp)
        self.q = ColumnParallelLinear(hidden, n_heads * hd, bias=False, gather_output=False)
        self.k = ColumnParallelLinear(hidden, n_heads * hd, bias=False, gather_output=False)
        self.v = ColumnParallelLinear(hidden, n_heads * hd, bias=False, gather_output=False)
        self.o = RowParallelLinear(n_heads * hd, hidden, bias=False, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        assert q.shape[-1] == self.n_heads_local * self.hd, "pad_model was not applied"
        return self.o(attend(q, k, v, self.hd, seq_first=False))


class TwoBlocks(nn.Module):
    def __init__(self, attention: nn.Module, mlp_up: nn.Module, mlp_down: nn.Module) -> None:
        super().__init__()
        self.attention, self.up, self.down = attention, mlp_up, mlp_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.down(F.gelu(self.up(x)))


def _attention_model(hidden: int, n_heads: int, hd: int) -> tuple[nn.Module, TwoBlocks]:
    """A reference attention + MLP and the parallel copy holding its weights."""
    tp, rank = _tp()
    ref_attn = RefAttention(hidden, n_heads, n_heads, hd)
    ref = TwoBlocks(ref_attn, nn.Linear(hidden, 32), nn.Linear(32, hidden))
    par_attn = PaddableAttention(hidden, n_heads, hd)
    par = TwoBlocks(
        par_attn,
        ColumnParallelLinear(hidden, 32, gather_output=False),
        RowParallelLinear(32, hidden, input_is_parallel=True),
    )
    with torch.no_grad():
        for name in "qkv":
            getattr(par_attn, name).weight.copy_(getattr(ref_attn, name).weight.chunk(tp)[rank])
        par_attn.o.weight.copy_(ref_attn.o.weight.chunk(tp, dim=1)[rank])
        for mod_par, mod_ref, dim in ((par.up, ref.up, 0), (par.down, ref.down, 1)):
            mod_par.weight.copy_(mod_ref.weight.chunk(tp, dim=dim)[rank])
            mod_par.bias.copy_(mod_ref.bias.chunk(tp)[rank] if dim == 0 else mod_ref.bias)
    return ref, par


def _reference_output(ref: TwoBlocks, x: torch.Tensor, hd: int) -> torch.Tensor:
    attn = ref.attention  # the reference attention without its norm
    h = x + attn.o(attend(attn.q(x), attn.k(x), attn.v(x), hd, False))
    return h + ref.down(F.gelu(ref.up(h)))


def check_pad_model_head_aligned() -> None:
    """3 heads over TP 2 or 4, head_aligned=True: 4 whole heads, the attention unchanged.
    NxD's pad_hook_fn semantics: called on every module of the padded region."""
    tp, _ = _tp()
    hidden, n_heads, hd = 16, 3, 4
    ref, par = _attention_model(hidden, n_heads, hd)
    seen: list[tuple[str, float]] = []
    pad_model(
        par,
        tp,
        n_heads,
        wrapped_classes=(PaddableAttention,),
        pad_hook_fn=lambda m, ratio: seen.append((type(m).__name__, ratio)),
        head_aligned=True,
    )
    linears = ["ColumnParallelLinear"] * 3 + ["RowParallelLinear"]
    assert seen == [(name, 4 / 3) for name in [*linears, "PaddableAttention"]]
    assert par.attention.q.output_size == 4 * hd
    assert par.up.output_size == 32  # outside wrapped_classes: untouched
    x = torch.randn(B, S, hidden)
    torch.testing.assert_close(par(x), _reference_output(ref, x, hd), **BLOCK)
    # NxD's per-rank layout splits heads here (a rank's original shard is 1.5 or 0.75 heads),
    # so the same attention padded that way computes something else: why head_aligned exists.
    ref2, nxd_padded = _attention_model(hidden, n_heads, hd)
    pad_model(nxd_padded, tp, n_heads, wrapped_classes=(PaddableAttention,))
    assert not torch.allclose(nxd_padded(x), _reference_output(ref2, x, hd), **BLOCK)
    _raises(lambda: pad_model(par, tp + 1, n_heads), f"tp_degree({tp + 1})")


def check_pad_model_nxd_layout() -> None:
    """NxD's layout: every rank zero-pads its own shard (so per-rank state dicts are NxD's);
    a Column -> GeLU -> Row block computes what it did before, outputs and input gradients;
    n_heads=1 is NxD's own test (each shard grows tp times)."""
    tp, rank = _tp()
    hidden, width = 16, 12
    for n_heads in (3, 1):
        n_padded = n_heads + get_number_of_extra_heads(n_heads, tp)
        local, new_local = width // tp, width // tp * n_padded // n_heads
        up = ColumnParallelLinear(hidden, width, gather_output=False)
        down = RowParallelLinear(width, hidden, input_is_parallel=True)
        gathered = ColumnParallelLinear(hidden, width, gather_output=True)
        model = nn.ModuleDict({"up": up, "down": down, "gathered": gathered})
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        x = torch.randn(B, S, hidden)
        x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, g_out_ref = down(F.gelu(up(x_ref))), gathered(x)
        pad_model(model, tp, n_heads)
        after = model.state_dict()
        assert after["up.weight"].shape == (new_local, hidden)
        assert after["down.weight"].shape == (hidden, new_local)
        torch.testing.assert_close(after["up.weight"][:local], before["up.weight"], **EXACT)
        torch.testing.assert_close(after["up.bias"][:local], before["up.bias"], **EXACT)
        torch.testing.assert_close(after["down.weight"][:, :local], before["down.weight"], **EXACT)
        assert torch.count_nonzero(after["up.weight"][local:]) == 0
        assert torch.count_nonzero(after["down.weight"][:, local:]) == 0
        torch.testing.assert_close(after["down.bias"], before["down.bias"], **EXACT)
        assert (up.output_size, down.input_size) == (new_local * tp, new_local * tp)
        # The full tensor interleaves each rank's rows with its zeros: [W_0; 0; W_1; 0; ...].
        full = full_tensor(up.weight).reshape(tp, new_local, hidden)
        torch.testing.assert_close(full[rank, :local], before["up.weight"], **EXACT)
        out = down(F.gelu(up(x_par)))
        torch.testing.assert_close(out, out_ref, **FP32)
        g = torch.randn_like(out)
        (out_ref * g).sum().backward()
        (out * g).sum().backward()
        torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
        # A gathered Column: its full bias follows the gathered, per-rank-padded layout.
        g_out = gathered(x).reshape(B, S, tp, new_local)
        torch.testing.assert_close(g_out[..., :local], g_out_ref.reshape(B, S, tp, local), **FP32)
        assert torch.count_nonzero(g_out[..., local:]) == 0
        assert after["gathered.bias"].shape == (new_local * tp,)


CHECKS: dict[str, Callable[[], None]] = {
    "qkv_gqa_2kv": lambda: check_qkv_gather(8, 2, 4, fuse=False, with_head_dim=False),
    "qkv_gqa_2kv_fused": lambda: check_qkv_gather(8, 2, 4, fuse=True, with_head_dim=False),
    "qkv_gqa_3kv_head_dim": lambda: check_qkv_gather(12, 3, 2, fuse=False, with_head_dim=True),
    "qkv_errors": check_qkv_errors,
    "attention_block": lambda: check_attention_block(sequence_parallel=False),
    "attention_block_sequence_parallel": lambda: check_attention_block(sequence_parallel=True),
    "pad_model_head_aligned": check_pad_model_head_aligned,
    "pad_model_nxd_layout": check_pad_model_nxd_layout,
}


def run_checks(tp: int) -> list[str]:
    """Every check on this rank, in order (see ``run_named_checks``)."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return run_named_checks(CHECKS, seed=200, context=f"tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_one_process(tp: int) -> None:
    """Every check of CHECKS on ``tp`` ranks (one spawn); a failure names its check."""
    assert run_distributed(run_checks, tp, tp) == [list(CHECKS)] * tp
