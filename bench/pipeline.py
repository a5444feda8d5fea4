"""Pipeline bubble and step time: nxd's schedules vs theory and vs torch.distributed.pipelining.

    .venv/bin/python bench/pipeline.py [--hidden 512 [128 ...]] [--layers 8] [--microbatches 8]

A GPT (plain PyTorch TinyGPT) split in the middle, on ``p`` gloo ranks (one thread each), at
each ``--hidden`` size in turn (~70 s for the default 512). 512 is where compute dominates (an
action takes ~40-110 ms on one CPU core, so p2p latency and Python bookkeeping are ~1 % of it);
128 is the tiny CI-sized model of the first benchmark (5-10 ms actions: the same fixed
per-action costs weigh as much as the bubble). For each nxd schedule (GPipe, 1F1B,
interleaved 1F1B with v=2, ZB-H1; 1F1B also with synchronous p2p batches instead of gloo's
asynchronous sends) it reports the median step time and three bubbles:

* measured: ``1 - sum_r compute_r / (p * wall)`` from the per-rank timelines;
* theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) for
  ZB-H1 (equal stages, F = I = W in cost);
* replay: this schedule re-executed on paper with every action's *measured* compute time
  and free communication. Theory assumes equal stages and unit costs; the replay keeps the
  schedule but uses the real costs (stage imbalance, B ≈ 2F, I ≠ W), so measured − replay
  is what the runtime itself adds (p2p latency, bookkeeping), and replay − theory what the
  model's costs do to the schedule.

torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B run the same model and split in
the same run, interleaved round-robin with nxd's, for step time.
Writes bench/results/pipeline.json and prints it.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_pipeline import ActionKind, NxDPPModel, PipelineSchedule, dry_run
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import run_distributed

logger = logging.getLogger("bench.pipeline")
MODEL = {"vocab": 256, "heads": 4, "max_positions": 64}
SEQ, MICRO_BATCH = 64, 2


class _TorchStage(nn.Module):
    """One half of TinyGPT as a torch.distributed.pipelining stage (activations in, out)."""

    def __init__(self, model: TinyGPT, first: bool, layers: range) -> None:
        super().__init__()
        self.first = first
        self.wte = model.wte if first else None
        self.wpe = model.wpe if first else None
        self.blocks = nn.ModuleList(model.h[i] for i in layers)
        self.ln_f = None if first else model.ln_f
        self.lm_head = None if first else model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1])
            x = self.wte(x) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        if not self.first:
            x = self.lm_head(self.ln_f(x))
        return x


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))


def _time_round_robin(
    steps: dict[str, Any], after: dict[str, Any], repeats: int
) -> dict[str, list[float]]:
    """One step of every configuration per round, so machine noise hits all of them alike.

    ``after[name]`` (bubble bookkeeping: gathering timelines) runs outside the timed region.
    """
    for name, step in steps.items():
        step()  # warm-up: shape exchange, allocator
        if name in after:
            after[name]()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            if name in after:
                after[name]()
    return times


def replay(schedule: PipelineSchedule, seconds: dict[tuple[int, str], float]) -> float:
    """Bubble of ``schedule`` executed with compute times ``seconds[(rank, "1F0")]``, free p2p.

    Each rank runs its compute actions in order; F of stage s waits for F of s-1, B or I of s
    for B or I of s+1 (and its own F), W for its I: the dependencies of asynchronous sends.
    """
    p, last = schedule.num_ranks, schedule.num_stages - 1
    fwd, weight = ActionKind.FORWARD, ActionKind.BACKWARD_WEIGHT
    queues = [[a for a in actions if a.kind.is_compute] for actions in schedule.actions]
    done: dict[tuple[int, str, int], float] = {}  # (stage, "F" or "B", microbatch) -> end
    free, busy = [0.0] * p, 0.0
    while any(queues):
        progressed = False
        for rank in range(p):
            while queues[rank]:
                action = queues[rank][0]
                s, mb, kind = action.stage, action.microbatch, action.kind
                if kind is fwd:
                    deps = [(s - 1, "F", mb)] if s > 0 else []
                elif kind is weight:
                    deps = [(s, "B", mb)]
                else:
                    deps = [(s, "F", mb)] + ([(s + 1, "B", mb)] if s < last else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [done[d] for d in deps])
                cost = seconds[(rank, str(action))]
                free[rank] = start + cost
                busy += cost
                if kind is not weight:
                    done[(s, "F" if kind is fwd else "B", mb)] = free[rank]
                queues[rank].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"replay of {schedule.name} is stuck")
    return 1.0 - busy / (p * max(free))


def bench_rank(hidden: int, layers: int, microbatches: int, repeats: int) -> dict[str, Any]:
    state = nxd_state.initialize_model_parallel(
        pipeline_model_parallel_size=torch.distributed.get_world_size()
    )
    p, rank = state.pipeline_parallel_size, state.pipeline_parallel_rank
    torch.manual_seed(0)
    reference = TinyGPT(layers=layers, hidden=hidden, **MODEL)
    ids = torch.randint(0, MODEL["vocab"], (MICRO_BATCH * microbatches, SEQ))
    steps: dict[str, Any] = {}
    bubbles: dict[str, list[float]] = {}
    replays: dict[str, list[float]] = {}
    after: dict[str, Any] = {}
    theory: dict[str, float] = {}
    scheduled: dict[str, float] = {}
    m = microbatches
    configs = [("gpipe", 1, True), ("1f1b", 1, True), ("1f1b", 1, False)]
    configs += [("interleaved_1f1b", 2, True), ("zb_h1", 1, True)]
    for name, v, async_sends in configs:
        per = layers // (p * v)
        model = NxDPPModel(
            copy.deepcopy(reference),
            transformer_layer_cls=Block,
            num_microbatches=microbatches,
            pipeline_cuts=[f"h.{per * (k + 1) - 1}" for k in range(p * v - 1)],
            virtual_pipeline_size=v,
            schedule=name,
            async_sends=async_sends,
        )
        label = f"nxd {name}" + (f" v={v}" if v > 1 else "") + ("" if async_sends else " sync p2p")
        bubbles[label], replays[label] = [], []

        def step(model: NxDPPModel = model) -> None:
            model.run_train(input_ids=ids, labels=ids)
            for param in model.parameters():
                param.grad = None

        def bubble(
            model: NxDPPModel = model,
            bubbles: list[float] = bubbles[label],
            replays: list[float] = replays[label],
        ) -> None:
            timeline = model.timeline
            assert timeline is not None
            computes = [(e.action, e.end - e.start) for e in timeline.entries if e.compute]
            mine = (timeline.compute_s, timeline.wall_s, computes)
            gathered: list[Any] = [None] * p
            torch.distributed.all_gather_object(gathered, mine)
            total_compute = sum(g[0] for g in gathered)
            wall = max(g[1] for g in gathered)
            bubbles.append(1.0 - total_compute / (p * wall))
            seconds = {(r, a): t for r, g in enumerate(gathered) for a, t in g[2]}
            replays.append(replay(model.schedule, seconds))

        steps[label], after[label] = step, bubble
        scheduled[label] = dry_run(model.schedule).bubble_fraction()
        theory[label] = {
            "gpipe": (p - 1) / (m + p - 1),
            "1f1b": (p - 1) / (m + p - 1),
            "interleaved_1f1b": (p - 1) / (v * m + p - 1),
            "zb_h1": (p - 1) / (3 * m + p - 1),
        }[name]
    steps.update(_torch_peer(reference, ids, layers, microbatches, p, rank))
    times = _time_round_robin(steps, after, repeats)
    results: dict[str, Any] = {}
    for label, seconds in times.items():
        results[label] = {"step_s_median": statistics.median(seconds)}
        if label in bubbles:
            results[label]["bubble_measured_median"] = statistics.median(bubbles[label][1:])
            results[label]["bubble_replay_measured_costs"] = statistics.median(replays[label][1:])
            results[label]["bubble_theory"] = theory[label]
            results[label]["bubble_of_schedule_unit_costs"] = scheduled[label]
    return results


def _torch_peer(
    reference: TinyGPT, ids: torch.Tensor, layers: int, m: int, p: int, rank: int
) -> dict[str, Any]:
    """torch.distributed.pipelining on the same model and split (p = 2): one step each."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if p != 2:
        return {}
    out: dict[str, Any] = {}
    half = layers // 2
    for name, cls in [("torch ScheduleGPipe", ScheduleGPipe), ("torch Schedule1F1B", Schedule1F1B)]:
        model = copy.deepcopy(reference)
        module = _TorchStage(model, rank == 0, range(0, half) if rank == 0 else range(half, layers))
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        schedule = cls(stage, m, loss_fn=_lm_loss)

        def step(schedule: Any = schedule, module: nn.Module = module) -> None:
            if rank == 0:
                schedule.step(ids)
            else:
                schedule.step(target=ids)
            for param in module.parameters():
                param.grad = None

        out[name] = step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    by_size: dict[str, Any] = {}
    for hidden in args.hidden:
        logger.info(
            "hidden %d: %d ranks, %d layers, m=%d",
            hidden,
            args.ranks,
            args.layers,
            args.microbatches,
        )
        per_rank = run_distributed(
            bench_rank, args.ranks, hidden, args.layers, args.microbatches, args.steps, timeout=900
        )
        results = per_rank[0]  # step times and bubbles are global (barriers, gathered timelines)
        baseline = {k: v["step_s_median"] for k, v in results.items() if k.startswith("torch")}
        for entry in results.values():
            for peer, seconds in baseline.items():
                entry[f"step_ratio_vs_{peer.split()[1]}"] = entry["step_s_median"] / seconds
        by_size[f"hidden_{hidden}"] = results
    report = {
        "config": {
            "ranks": args.ranks,
            "hidden": args.hidden,
            "layers": args.layers,
            "microbatches": args.microbatches,
            "steps": args.steps,
            "seq": SEQ,
            "micro_batch": MICRO_BATCH,
            **MODEL,
            "torch": torch.__version__,
            "threads_per_rank": 1,
        },
        "results": by_size,
    }
    path = Path(__file__).parent / "results" / "pipeline.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
