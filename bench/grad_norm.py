"""Gradient norm and clipping: nxd_layers vs torch on the same gradients, side by side.

    .venv/bin/python bench/grad_norm.py [--rounds 30]

One step's clipping is ||g||_p over every gradient, then g <- g * min(1, c / (||g||_p + eps)).
Measured in one run, one intra-op thread per process, calls alternating (order rotated every
round), the gradients restored from a saved copy before every call (untimed) so that every
call clips (norm ~ 10^3, max_norm 1):

* TP=1 (one process), float32 and bfloat16 gradients, p = 2 and p = inf:
  ``nxd_layers.clip_grad_norm`` vs ``torch.nn.utils.get_total_norm`` +
  ``clip_grads_with_norm_`` (foreach); the norm alone too (``get_grad_norm`` vs
  ``get_total_norm``), to show where the time goes;
* TP=2 (2 gloo ranks), float32, p = 2: nxd's sharded parameters (matrices split by rows,
  vectors replicated) vs the same tensors as DTensors on a 1-D mesh (``Shard(0)`` /
  ``Replicate()``) clipped by ``torch.nn.utils.clip_grad_norm_`` (what a DTensor model's
  training loop calls). Time of rank 0 after a barrier.

The gradients have the shapes of a small Llama (h=512, 4 layers, vocabulary 4096). Ratios
nxd / torch of the medians (ns per element) are reported; goal <= 1.0 (from issue 28). The
norms each side computes are recorded (bf16: torch's norm is a bfloat16 value, nxd's a float32
one accumulated in float32). Writes bench/results/grad_norm.json and prints it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nxd_state.testing import run_distributed

RESULTS = Path(__file__).parent / "results" / "grad_norm.json"
MAX_NORM = 1.0
GOAL = 1.0


def _shapes() -> list[tuple[int, ...]]:
    h, ffn, layers, vocab = 512, 1408, 4, 4096
    shapes: list[tuple[int, ...]] = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (3 * h, h), (h, h), (h,), (2 * ffn, h), (h, ffn)]
    return [*shapes, (h,), (vocab, h)]


def _race(
    calls: dict[str, Callable[[], Any]], restore: Callable[[], None], rounds: int, numel: int
) -> dict[str, dict[str, float]]:
    """ns per element of each call: median and quartiles, order rotated every round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for _ in range(2):  # warm-up
        for _, call in order:
            restore()
            call()
    for i in range(rounds):
        for name, call in order[i % len(order) :] + order[: i % len(order)]:
            restore()
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) / numel * 1e9)
    out = {}
    for name, samples in times.items():
        q1, median, q3 = statistics.quantiles(samples, n=4)
        out[name] = {
            "ns_per_element_median": round(median, 4),
            "q1": round(q1, 4),
            "q3": round(q3, 4),
        }
    return out


def _torch_clip(params: list[nn.Parameter], p: float) -> torch.Tensor:
    grads = [q.grad for q in params]
    total = torch.nn.utils.get_total_norm(grads, p, foreach=True)
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total, foreach=True)
    return total


def run_tp1(rounds: int) -> dict[str, Any]:
    """TP=1: nxd vs torch, norm + clip and norm alone, per dtype and norm type."""
    from nxd_layers import clip_grad_norm, get_grad_norm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        saved = [(torch.randn(s) * 10).to(dtype) for s in _shapes()]
        params = [nn.Parameter(torch.empty(s.shape, dtype=dtype)) for s in saved]
        for param, grad in zip(params, saved):
            param.grad = grad.clone()
        grads = [q.grad for q in params]
        numel = sum(g.numel() for g in grads)

        def restore() -> None:
            torch._foreach_copy_(grads, saved)  # noqa: B023

        for p in (2.0, math.inf):
            calls = {
                "nxd_clip_grad_norm": functools.partial(
                    clip_grad_norm, params, MAX_NORM, p, tensor_parallel_group=None
                ),
                "torch_total_norm_and_clip": functools.partial(_torch_clip, params, p),
                "nxd_get_grad_norm": functools.partial(
                    get_grad_norm, params, p, tensor_parallel_group=None
                ),
                "torch_get_total_norm": functools.partial(
                    torch.nn.utils.get_total_norm, grads, p, foreach=True
                ),
            }
            values = {}
            for name in ("nxd_get_grad_norm", "torch_get_total_norm"):
                restore()
                values[name] = float(calls[name]())
            m = _race(calls, restore, rounds, numel)

            def ratio(a: str, b: str) -> float:
                return round(m[a]["ns_per_element_median"] / m[b]["ns_per_element_median"], 3)  # noqa: B023

            out[f"{str(dtype).removeprefix('torch.')}_p{p:g}"] = {
                "elements": numel,
                "measurements": m,
                "norms": values,
                "clip_nxd_over_torch": ratio("nxd_clip_grad_norm", "torch_total_norm_and_clip"),
                "norm_nxd_over_torch": ratio("nxd_get_grad_norm", "torch_get_total_norm"),
            }
    return out


def tp2_rank(rounds: int) -> dict[str, Any]:
    """One rank of TP=2: nxd's local shards vs DTensors of the same shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import nxd_state
    from nxd_layers import clip_grad_norm

    torch.set_num_threads(1)
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same full gradients on both ranks
    full = [torch.randn(s) * 10 for s in _shapes()]
    nxd_params, dt_params, nxd_saved, dt_saved = [], [], [], []
    for grad in full:
        placement = Shard(0) if grad.dim() == 2 else Replicate()
        local = grad.chunk(2, dim=0)[rank].clone() if grad.dim() == 2 else grad.clone()
        param = nn.Parameter(torch.empty_like(local))
        param.tensor_model_parallel = grad.dim() == 2
        param.grad = local.clone()
        nxd_params.append(param)
        nxd_saved.append(local)
        dt_grad = distribute_tensor(grad, mesh, [placement])
        dt_param = nn.Parameter(distribute_tensor(torch.empty_like(grad), mesh, [placement]))
        dt_param.grad = dt_grad
        dt_params.append(dt_param)
        dt_saved.append(dt_grad.to_local().clone())
    numel = sum(g.numel() for g in full)
    nxd_grads = [q.grad for q in nxd_params]
    dt_locals = [q.grad.to_local() for q in dt_params]

    def restore() -> None:
        torch._foreach_copy_(nxd_grads, nxd_saved)
        torch._foreach_copy_(dt_locals, dt_saved)
        dist.barrier()

    calls = {
        "nxd_clip_grad_norm": lambda: clip_grad_norm(nxd_params, MAX_NORM, 2.0),
        "dtensor_clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(
            dt_params, MAX_NORM, 2.0, foreach=True
        ),
    }
    restore()
    norms = {"nxd": float(calls["nxd_clip_grad_norm"]())}
    restore()
    total = calls["dtensor_clip_grad_norm_"]()
    norms["dtensor"] = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
    norms["float64_reference"] = float(sum(g.double().pow(2).sum() for g in full) ** 0.5)
    m = _race(calls, restore, rounds, numel)
    return {
        "elements_full_model": numel,
        "measurements_rank0": m,
        "norms": norms,
        "clip_nxd_over_dtensor": round(
            m["nxd_clip_grad_norm"]["ns_per_element_median"]
            / m["dtensor_clip_grad_norm_"]["ns_per_element_median"],
            3,
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    tp1 = run_tp1(args.rounds)
    tp2 = run_distributed(tp2_rank, 2, args.rounds, timeout=900)[0]
    result = {
        "benchmark": "grad_norm",
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1min_before": load_before,
            "load_avg_1min_after": os.getloadavg()[0],
        },
        "torch": torch.__version__,
        "threads_per_process": 1,
        "max_norm": MAX_NORM,
        "tp1": tp1,
        "tp2_fp32_p2": tp2,
        "goals": {
            **{
                f"tp1 {k} clip nxd/torch <= {GOAL}": v["clip_nxd_over_torch"]
                for k, v in tp1.items()
            },
            f"tp2 clip nxd/dtensor <= {GOAL}": tp2["clip_nxd_over_dtensor"],
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
