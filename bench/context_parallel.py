"""Context parallelism: attention forward+backward time, bytes sent, activation memory.

    .venv/bin/python bench/context_parallel.py [--seq 2048] [--heads 8] [--head-dim 64] [--reps 5]

Measured on gloo ranks, one thread each (CPU):

* time of causal attention forward+backward on the whole sequence: one process (torch's SDPA)
  vs CP=2 with nxd's ring and all-to-all attention vs torch's experimental
  ``torch.distributed.tensor.experimental.context_parallel`` (its ring, round-robin load
  balancing) at the same degree, the slowest rank's median over ``--reps``;
* bytes each rank sends per attention layer (nxd_state's counter) vs theory: ring forward
  ``(n-1)`` K/V blocks of ``S/n`` tokens, backward ``(n-1)`` K/V blocks plus ``n`` dK/dV
  blocks; all-to-all ``(n-1)/n`` of Q, K, V, O forward and of their gradients backward;
* activation memory per rank (bytes saved for backward, counted by
  ``torch.autograd.graph.saved_tensors_hooks``, each storage once) of one Llama-style
  attention + MLP block at CP 1, 2, 4, against ``1/CP`` of CP=1's.

Results go to bench/results/context_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nxd_state
from nxd_layers.context_parallel import (
    context_parallel_attention,
    split_for_context_parallel,
)
from nxd_state.testing import run_distributed

RESULTS = Path(__file__).parent / "results" / "context_parallel.json"


def qkv(seq: int, heads: int, kv_heads: int, hd: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(1, h, seq, hd, generator=g) for h in (heads, kv_heads, kv_heads, heads)
    )


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_process(seq: int, heads: int, hd: int, reps: int) -> float:
    q, k, v, w = qkv(seq, heads, heads, hd)

    def step() -> None:
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        (F.scaled_dot_product_attention(a, b, c, is_causal=True) * w).sum().backward()

    return _time(step, reps)


def nxd_cp(seq: int, heads: int, kv_heads: int, hd: int, reps: int) -> dict:
    nxd_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    group = nxd_state.get_context_model_parallel_group()
    q, k, v, w = (
        split_for_context_parallel(t, group, dim=2) for t in qkv(seq, heads, kv_heads, hd)
    )
    out = {}
    for algorithm in ("ring", "all_to_all"):

        def step(algorithm: str = algorithm) -> None:
            a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
            (context_parallel_attention(a, b, c, algorithm=algorithm) * w).sum().backward()

        seconds = _time(step, reps)
        with nxd_state.count_collectives() as counter:
            step()
        sent = sum(
            s.wire_bytes for (op, _), s in counter.stats.items() if op in ("send", "all_to_all")
        )
        out[algorithm] = {"seconds": seconds, "bytes_sent": sent}
    return out


def torch_cp(seq: int, heads: int, hd: int, reps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v, w = qkv(seq, heads, heads, hd)
    # Its buffers are sharded in place and must not require grad: q, k, v are scaled by
    # parameters inside (as a model's projections would make them), so the backward through
    # attention (dq, dk, dv) runs in full.
    scales = [torch.ones((), requires_grad=True) for _ in range(3)]

    def step() -> None:
        a, b, c, ww = (t.clone() for t in (q, k, v, w))
        with context_parallel(mesh, buffers=[a, b, c, ww], buffer_seq_dims=[2, 2, 2, 2]):
            qq, kk, vv = (t * s for t, s in zip((a, b, c), scales))
            (F.scaled_dot_product_attention(qq, kk, vv, is_causal=True) * ww).sum().backward()

    try:
        return {"seconds": _time(step, reps)}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}


def block_activations(seq: int, hidden: int, heads: int, kv_heads: int, algorithm: str) -> int:
    """Bytes saved for backward by one attention + MLP block on this rank's slice."""
    cp = dist.get_world_size()
    nxd_state.initialize_model_parallel(context_parallel_size=cp)
    group = nxd_state.get_context_model_parallel_group()
    torch.manual_seed(0)
    hd = hidden // heads
    wq, wk, wv, wo = (
        torch.randn(o, hidden, requires_grad=True)
        for o in (hidden, kv_heads * hd, kv_heads * hd, hidden)
    )
    wg, wu = (torch.randn(4 * hidden, hidden, requires_grad=True) for _ in range(2))
    wd = torch.randn(hidden, 4 * hidden, requires_grad=True)
    x = split_for_context_parallel(torch.randn(1, seq, hidden), group).requires_grad_(True)
    seen: dict[int, int] = {}
    # Weights (and views of them, as w.T) and the block's input are not activations.
    skip = {w.untyped_storage().data_ptr() for w in (wq, wk, wv, wo, wg, wu, wd, x)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        b, s = x.shape[:2]
        h = F.rms_norm(x, (hidden,))
        q, k, v = ((h @ w.T).view(b, s, -1, hd).transpose(1, 2) for w in (wq, wk, wv))
        a = context_parallel_attention(q, k, v, algorithm=algorithm, group=group)
        x2 = x + a.transpose(1, 2).reshape(b, s, hidden) @ wo.T
        h2 = F.rms_norm(x2, (hidden,))
        y = x2 + (F.silu(h2 @ wg.T) * (h2 @ wu.T)) @ wd.T
    y.sum().backward()
    return sum(seen.values())


def run_activations(seq: int, hidden: int, heads: int, kv_heads: int) -> dict:
    out = {}
    for algorithm in ("ring", "all_to_all"):
        per_cp = {}
        for cp in (1, 2, 4):
            per_rank = run_distributed(
                block_activations, cp, seq, hidden, heads, kv_heads, algorithm
            )
            per_cp[cp] = max(per_rank)
        out[algorithm] = {
            f"cp{cp}": {
                "bytes_per_rank": b,
                "fraction_of_cp1": b / per_cp[1],
                "vs_ideal_1_over_cp": b / (per_cp[1] / cp),
            }
            for cp, b in per_cp.items()
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, s, h, hkv, d = 2, args.seq, args.heads, args.kv_heads, args.head_dim
    single = one_process(s, h, d, args.reps)
    ours = run_distributed(nxd_cp, n, s, h, hkv, d, args.reps)
    theirs = run_distributed(torch_cp, n, s, h, d, args.reps)
    elt = 4
    kv_block = 2 * hkv * (s // n) * d * elt
    theory = {
        "ring": (n - 1) * kv_block + (n - 1) * kv_block + n * kv_block,
        "all_to_all": 2 * (n - 1) / n * (2 * h + 2 * hkv) * (s // n) * d * elt,
    }
    result = {
        "config": {
            "seq": s,
            "heads": h,
            "kv_heads": hkv,
            "head_dim": d,
            "cp": n,
            "dtype": "float32",
        },
        "one_process_seconds": single,
        "torch_context_parallel": theirs[0]
        if "error" in theirs[0]
        else {"seconds": max(r["seconds"] for r in theirs)},
    }
    for algorithm in ("ring", "all_to_all"):
        seconds = max(r[algorithm]["seconds"] for r in ours)
        sent = max(r[algorithm]["bytes_sent"] for r in ours)
        entry = {
            "seconds": seconds,
            "vs_one_process": seconds / single,
            "bytes_sent_per_rank": sent,
            "theory_bytes": theory[algorithm],
            "bytes_vs_theory": sent / theory[algorithm],
        }
        if "seconds" in result["torch_context_parallel"]:
            entry["vs_torch_context_parallel"] = (
                seconds / result["torch_context_parallel"]["seconds"]
            )
        result[algorithm] = entry
    result["activation_memory"] = run_activations(s, 256, 8, 4)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
