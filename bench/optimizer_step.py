"""The optimizer step of a bf16 model with fp32 master weights: NxDOptimizer vs the same
bookkeeping written by hand, side by side in one process (CPU, one intra-op thread).

One step of every configuration: θ32 <- AdamW(θ32, float32(g)), θ <- bf16(θ32), over a
Llama-shaped list of bf16 parameters (h = 320, FFN 864, 22 layers, vocabulary 4096: 201
tensors from 320 to 1.3M elements, 29.6M in all). Configurations:

* ``nxd``: ``NxDOptimizer`` without ZeRO-1, ``use_master_weights``, no clipping;
* ``peer``: ``torch.optim.AdamW(foreach=True)`` over fp32 masters allocated once, their
  ``.grad`` persistent fp32 tensors: ``_foreach_copy_`` of the bf16 gradients in, the step,
  ``_foreach_copy_`` of the masters out (the least a wrapper can do with per-tensor masters);
* ``nxd_zero1``: ``NxDOptimizer`` with ZeRO-1 at world size 1 (flat buffers per dtype);
* ``nxd_clip`` / ``peer_clip``: the same two with clipping to 1.0 (the peer with
  ``torch.nn.utils.get_total_norm`` + ``clip_grads_with_norm_``, foreach);
* ``nxd_fp32_acc``: ``NxDOptimizer`` with ``use_fp32_grad_acc`` (its cast happens during the
  backward, so its step does less: shown, not paired).

Every round each configuration gets the same bf16 gradients by ``torch.autograd.backward``
on its parameters (untimed, so fp32 accumulation hooks run), then its timed step; the order
is shuffled every round. The step time of ``nxd`` is compared with ``peer`` *in the same
round* (median of the paired ratios, quartiles); ``nxd_clip`` with ``peer_clip``. The same
for the thread's CPU time in the step (``time.thread_time``; one intra-op thread), which other
jobs on the machine disturb less than wall time. Each
configuration's step is also profiled once (``torch.profiler``, CPU): the count of top-level
operators it issues (``aten::`` events without an enclosing operator), of all operators, and
the bytes they allocate.
Goal (issue 28 item 4): ``nxd`` ≤ 1.05× ``peer``.

    .venv/bin/python bench/optimizer_step.py [--rounds 30] [--before PATH]

``--before`` embeds an earlier run's JSON (of this script at another commit) as ``before``;
``--code`` says what ran when it is not the checkout (``PYTHONPATH`` pointing elsewhere).
Writes bench/results/optimizer_step.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).parent / "results" / "optimizer_step.json"
GOAL = 1.05
LR = 1e-4
MAX_NORM = 1.0
CONFIGS = ("nxd", "peer", "nxd_zero1", "nxd_clip", "peer_clip", "nxd_fp32_acc")
PAIRS = {"nxd": "peer", "nxd_clip": "peer_clip", "nxd_zero1": "peer"}


def _shapes() -> list[tuple[int, ...]]:
    h, ffn, layers, vocab = 320, 864, 22, 4096
    shapes: list[tuple[int, ...]] = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (h, h), (h, h), (h, h), (h, h), (h,), (ffn, h), (ffn, h), (h, ffn)]
    return [*shapes, (h,), (vocab, h)]


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter((torch.randn(s) * 0.02).bfloat16()) for s in _shapes()]


def _nxd(params: list[nn.Parameter], *, zero1: bool, clip: bool, fp32_acc: bool) -> Any:
    from nxd_optim import MixedPrecisionConfig, NxDOptimizer, OptimizerConfig

    return NxDOptimizer(
        params,
        torch.optim.AdamW,
        config=OptimizerConfig(zero_one_enabled=zero1, grad_clipping=clip, max_grad_norm=MAX_NORM),
        mixed_precision=MixedPrecisionConfig(use_master_weights=True, use_fp32_grad_acc=fp32_acc),
        lr=LR,
        foreach=True,
    )


class Peer:
    """fp32 masters and their gradients allocated once; per step two ``_foreach_copy_`` and
    ``torch.optim.AdamW(foreach=True)`` (with ``clip``: torch's foreach norm and clip)."""

    def __init__(self, params: list[nn.Parameter], *, clip: bool) -> None:
        self.params = params
        self.masters = [p.detach().float() for p in params]
        for master in self.masters:
            master.grad = torch.zeros_like(master)
        self.grads = [m.grad for m in self.masters]
        self.clip = clip
        self.inner = torch.optim.AdamW(self.masters, lr=LR, foreach=True)

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_(self.grads, [p.grad for p in self.params])
        if self.clip:
            total = torch.nn.utils.get_total_norm(self.grads, 2.0, foreach=True)
            torch.nn.utils.clip_grads_with_norm_(self.masters, MAX_NORM, total, foreach=True)
        self.inner.step()
        torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


def _build(kind: str) -> tuple[list[nn.Parameter], Any]:
    params = _params()
    if kind.startswith("peer"):
        return params, Peer(params, clip=kind.endswith("clip"))
    return params, _nxd(
        params,
        zero1=kind == "nxd_zero1",
        clip=kind.endswith("clip"),
        fp32_acc=kind == "nxd_fp32_acc",
    )


def _op_counts(step: Callable[[], Any]) -> dict[str, int]:
    """Top-level and all ``aten::`` operators of one call of ``step``, and the bytes its
    operators allocate (each allocation counted once, frees not subtracted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in events)
    return {"top_level_ops": len(top), "all_ops": len(events), "allocated_bytes": allocated}


def _ratios(mine: list[float], theirs: list[float]) -> dict[str, Any]:
    ratios = sorted(a / b for a, b in zip(mine, theirs, strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "median": statistics.median(ratios),
        "quartiles": [q1, q3],
        "rounds_at_or_below_1": sum(r <= 1.0 for r in ratios) / len(ratios),
    }


def bench_rank(rounds: int, warmup: int) -> dict[str, Any]:
    import nxd_state

    torch.set_num_threads(1)
    nxd_state.initialize_model_parallel()
    gen = torch.Generator().manual_seed(1)
    saved = [(torch.randn(s, generator=gen) * 1e-2).bfloat16() for s in _shapes()]
    runs = {kind: _build(kind) for kind in CONFIGS}
    times: dict[str, list[float]] = {kind: [] for kind in CONFIGS}
    cpu: dict[str, list[float]] = {kind: [] for kind in CONFIGS}

    def backward(kind: str) -> None:
        params, optimizer = runs[kind]
        optimizer.zero_grad()
        torch.autograd.backward(params, saved)

    for round_index in range(warmup + rounds):
        for kind in random.Random(round_index).sample(CONFIGS, len(CONFIGS)):
            backward(kind)
            start, start_cpu = time.perf_counter(), time.thread_time()
            runs[kind][1].step()
            if round_index >= warmup:
                times[kind].append(time.perf_counter() - start)
                cpu[kind].append(time.thread_time() - start_cpu)
    ops = {}
    for kind in CONFIGS:
        backward(kind)
        ops[kind] = _op_counts(runs[kind][1].step)
    reference = runs["peer"][0]
    return {
        "params": len(reference),
        "elements": sum(p.numel() for p in reference),
        "configs": {
            kind: {
                "step_ms_median": 1e3 * statistics.median(times[kind]),
                "step_ms_quartiles": [1e3 * q for q in statistics.quantiles(times[kind], n=4)[::2]],
                "cpu_ms_median": 1e3 * statistics.median(cpu[kind]),
                **ops[kind],
            }
            for kind in CONFIGS
        },
        "ratios": {f"{a}_over_{b}": _ratios(times[a], times[b]) for a, b in PAIRS.items()},
        "cpu_ratios": {f"{a}_over_{b}": _ratios(cpu[a], cpu[b]) for a, b in PAIRS.items()},
        # the same bf16 params after the same steps: every variant computes the same update
        "params_equal_to_peer": {
            kind: all(torch.equal(a, b) for a, b in zip(runs[kind][0], reference, strict=True))
            for kind in ("nxd", "nxd_zero1", "nxd_fp32_acc")
        },
    }


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=False, cwd=Path(__file__).parent
        ).stdout.strip()

    dirty = " (dirty)" if git("status", "--porcelain") else ""
    return git("rev-parse", "--short", "HEAD") + dirty


def main() -> None:
    from nxd_state.testing import add_preload, run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--code", default=None, help="what code ran (default: git HEAD)")
    args = parser.parse_args()
    add_preload("torch._dynamo", "nxd_optim")
    load_before = os.getloadavg()
    result = run_distributed(bench_rank, 1, args.rounds, args.warmup, timeout=1800)[0]
    ratio = result["ratios"]["nxd_over_peer"]["median"]
    configs = result["configs"]
    document: dict[str, Any] = {
        "benchmark": "optimizer_step",
        "model": "201 bf16 tensors (Llama h=320, 22 layers, vocab 4096), fp32 masters, AdamW",
        "backend": "CPU, one process, one intra-op thread",
        "code": args.code or _commit(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        **result,
        "goals": {  # pass / fail, as bench/compare.py reads them
            f"nxd step <= {GOAL} x peer (median of paired ratios)": ratio <= GOAL,
            "nxd top-level ops <= peer's": configs["nxd"]["top_level_ops"]
            <= configs["peer"]["top_level_ops"],
        },
    }
    if args.before is not None:
        document["before"] = json.loads(args.before.read_text())
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
