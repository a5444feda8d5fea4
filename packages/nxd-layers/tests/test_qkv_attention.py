"""The GQA QKV projection and a Llama-style GQA attention block, each against the same
unsharded model in one process, on 2 and 4 gloo ranks.

Every rank builds the reference from the same seed and loads its weights into the parallel
copy by slicing (K/V heads picked by the GQA grouping rule, independently of the layer's own
replication code); outputs, input gradients and every gradient are compared, and the gradient
norm / clipping against ``torch.nn.utils.clip_grad_norm_`` on the reference.

Tolerances (``_models.py``): fp32 with torch's defaults for the projections (same products,
sums split over ranks: a few ulps); rtol=atol=1e-5 for the attention block, where rounding
differences compound through RoPE and softmax (values O(1), any sharding error is O(1)).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nxd_state
from nxd_layers import (
    GQAQKVColumnParallelLinear,
    allreduce_sequence_parallel_gradients,
    clip_grad_norm,
    full_tensor,
    get_kv_size_multiplier,
)
from nxd_state.testing import load_sibling, run_distributed, run_named_checks

M = load_sibling(__file__, "_models")
FP32, BLOCK, EXACT, B, S = M.FP32, M.BLOCK, M.EXACT, M.B, M.S  # tolerances: see _models.py


# GQA QKV projection ------------------------------------------------------------------------
def check_qkv_gather(n_heads: int, n_kv: int, hd: int, fuse: bool, with_head_dim: bool) -> None:
    """gather_output=True: (Q, K, V) equal three nn.Linear; all gradients match."""
    tp, _ = M.tp_rank()
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
        bias_q = par.master_bias_qkv[: n_heads * hd].chunk(M.tp_rank()[0])[M.tp_rank()[1]]
        torch.testing.assert_close(par._parts("bias")[0], bias_q, rtol=0, atol=0)
    else:
        assert par.master_weight_qkv is None
        masters = {f"weight_{p}": getattr(par, f"master_weight_{p}") for p in "qkv"}
        assert masters["weight_k"].shape == (n_kv * hd, hidden)  # not replicated
        assert par.master_bias_k.shape == (n_kv * hd,)
    local = dict(zip("qkv", par._parts("weight")))
    torch.testing.assert_close(
        local["q"], masters["weight_q"].chunk(tp)[M.tp_rank()[1]], rtol=0, atol=0
    )
    for part in "kv":
        heads = masters[f"weight_{part}"].reshape(n_kv, hd, hidden)[M.kv_heads_of_rank(par, hd)]
        torch.testing.assert_close(local[part], heads.reshape(-1, hidden), rtol=0, atol=0)
    M.load_qkv(par, hd, *refs)
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
    M.load_qkv(holder, hd, *probe)
    return {name: p.detach() for name, p in holder.named_parameters()}


def check_qkv_errors() -> None:
    tp, _ = M.tp_rank()
    if tp < 2:
        return
    # 3 heads of 4 over TP: the heads do not divide; the message points to pad_model.
    M.raises(lambda: GQAQKVColumnParallelLinear(16, [3 * 4, 3 * 4], head_dim=4), "pad_model")
    M.raises(
        lambda: GQAQKVColumnParallelLinear(16, [8 * tp, 8 * tp - 4], head_dim=4),
        "num_heads",
    )
    M.raises(
        lambda: GQAQKVColumnParallelLinear(16, [4 * 8, 4 * 1], head_dim=4, kv_size_multiplier=1),
        "num_kv_heads(1) x kv_size_multiplier(1) = 1",
        f"smallest valid multiplier is {tp}",
    )
    M.raises(lambda: GQAQKVColumnParallelLinear(16, [32, 5]), "kv_size(5)", "kv_size_multiplier")
    M.raises(
        lambda: GQAQKVColumnParallelLinear(16, [32, 8], kv_size_multiplier=0), "kv_size_multiplier"
    )
    sp = GQAQKVColumnParallelLinear(16, [8 * tp, 8 * tp], sequence_parallel_enabled=True)
    M.raises(lambda: sp(torch.randn(S, 16)), "3-D input")


# Llama-style attention -------------------------------------------------------------------
def check_attention_block(sequence_parallel: bool) -> None:
    """GQA block: 8 Q heads, 2 KV heads (TP=4 replicates each KV head twice)."""
    tp, rank = M.tp_rank()
    hidden, n_heads, n_kv, hd = 32, 8, 2, 4
    ref = M.RefAttention(hidden, n_heads, n_kv, hd)
    par = M.ParallelAttention(hidden, n_heads, n_kv, hd, sequence_parallel)
    M.load_qkv(par.qkv, hd, ref.q, ref.k, ref.v)
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
    probe = M.RefAttention(hidden, n_heads, n_kv, hd)
    holder = M.ParallelAttention(hidden, n_heads, n_kv, hd, sequence_parallel)
    with torch.no_grad():
        for name, p in probe.named_parameters():
            p.copy_(dict(ref.named_parameters())[name].grad)
    M.load_qkv(holder.qkv, hd, probe.q, probe.k, probe.v)
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


CHECKS: dict[str, Callable[[], None]] = {
    "qkv_gqa_2kv": lambda: check_qkv_gather(8, 2, 4, fuse=False, with_head_dim=False),
    "qkv_gqa_2kv_fused": lambda: check_qkv_gather(8, 2, 4, fuse=True, with_head_dim=False),
    "qkv_gqa_3kv_head_dim": lambda: check_qkv_gather(12, 3, 2, fuse=False, with_head_dim=True),
    "qkv_errors": check_qkv_errors,
    "attention_block": lambda: check_attention_block(sequence_parallel=False),
    "attention_block_sequence_parallel": lambda: check_attention_block(sequence_parallel=True),
}


def run_checks(tp: int) -> list[str]:
    """Every check on this rank, in order (see ``run_named_checks``)."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return run_named_checks(CHECKS, seed=200, context=f"tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_and_attention_match_one_process(tp: int) -> None:
    """Every check of CHECKS on ``tp`` ranks (one spawn); a failure names its check."""
    assert run_distributed(run_checks, tp, tp) == [list(CHECKS)] * tp
