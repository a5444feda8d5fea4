"""Mixture of experts: layer step time at EP=2 vs replicated experts vs a loop over experts,
all-to-all bytes vs theory, tokens dropped per capacity factor.

    .venv/bin/python bench/moe.py [--tokens 1024] [--hidden 256] [--intermediate 512]
                                  [--experts 8] [--top-k 2] [--reps 5]

Measured on gloo ranks, one thread each (CPU), float32:

* ``loop_vs_bmm``: one process, the same tokens and weights: forward+backward of nxd's
  expert MLPs, both ways (``torch._grouped_mm`` over the rows sorted by expert, the default
  on CUDA; one zero-padded ``torch.bmm`` over experts, the default on CPU) vs a Python loop
  over experts (index the tokens of expert e, run its MLP, ``index_add`` the weighted result:
  Hugging Face Mixtral's loop). Goal: nxd <= 1.0x the loop.
* ``ep2`` vs ``replicated``: 2 ranks, ``--tokens`` tokens each. EP=2: each rank holds E/2
  experts, tokens go by all-to-all. Replicated (DP): each rank holds all E experts and runs
  its own tokens, then all-reduces the expert gradients (the DP sync EP avoids for experts).
  The slowest rank's median step.
* all-to-all bytes per rank and step (nxd_state's counter, bytes that leave the rank) vs
  theory ``T k H (ep-1)/ep`` elements each way (dispatch forward, combine forward, and the
  two gradients backward: 4 transfers per step), which holds when routing is balanced;
  ``sent_rows_theory`` is the same figure with this step's actual routing (per step a rank
  sends ``2 (out + in)`` rows: dispatch sends the ``out`` rows whose expert lives elsewhere,
  combine returns the ``in`` rows it received, and backward repeats both), which the counter
  must equal exactly.
* ``dropped``: fraction of the ``T k`` assignments dropped per capacity factor (random router,
  one process; the EP layer drops the same set by construction).

Results go to bench/results/moe.json.
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
from nxd_layers.moe import ExpertMLPsCapacityFactor, RouterTopK
from nxd_state import collectives
from nxd_state.testing import run_distributed

RESULTS = Path(__file__).parent / "results" / "moe.json"


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(cfg: dict, capacity_factor: float | None = None, group=None):
    torch.manual_seed(0)
    router = RouterTopK(cfg["experts"], cfg["top_k"], cfg["hidden"])
    experts = ExpertMLPsCapacityFactor(
        cfg["experts"],
        cfg["top_k"],
        cfg["hidden"],
        cfg["intermediate"],
        "silu",
        capacity_factor,
        True,
        expert_model_parallel_group=group,
    )
    return router, experts


def tokens(cfg: dict, seed: int) -> torch.Tensor:
    return torch.randn(cfg["tokens"], cfg["hidden"], generator=torch.Generator().manual_seed(seed))


def loop_experts(experts, x, affinities, index) -> torch.Tensor:
    """Hugging Face Mixtral's loop: per expert, its tokens through its MLP, added back."""
    out = torch.zeros_like(x)
    weights = affinities.gather(1, index)  # (T, k)
    for e in range(experts.num_experts):
        token, choice = (index == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ experts.gate_up_proj.weight[e]).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ experts.down_proj.weight[e]
        out = out.index_add(0, token, y * weights[token, choice].unsqueeze(1))
    return out


def loop_vs_bmm(cfg: dict, reps: int) -> dict:
    router, experts = build(cfg)
    x = tokens(cfg, 1)
    with torch.no_grad():
        _, affinities, index = router(x)

    def ours(grouped: bool) -> None:
        experts.grouped_mm = grouped
        xx = x.clone().requires_grad_(True)
        experts(xx, affinities, index).sum().backward()

    def loop() -> None:
        xx = x.clone().requires_grad_(True)
        loop_experts(experts, xx, affinities, index).sum().backward()

    exact = {}
    with torch.no_grad():
        want = loop_experts(experts, x, affinities, index)
        for grouped in (True, False):
            experts.grouped_mm = grouped
            exact[grouped] = float((experts(x, affinities, index) - want).abs().max())
    grouped_s, bmm = _time(lambda: ours(True), reps), _time(lambda: ours(False), reps)
    looped = _time(loop, reps)
    experts.grouped_mm = None
    return {
        "grouped_seconds": grouped_s,
        "bmm_seconds": bmm,
        "loop_seconds": looped,
        "grouped_over_loop": grouped_s / looped,
        "bmm_over_loop": bmm / looped,
        "grouped_over_bmm": grouped_s / bmm,
        "goal": "<= 1.0 (bmm, the CPU default, over the loop)",
        "max_abs_difference": exact[True],
        "max_abs_difference_bmm": exact[False],
    }


def ep_step(cfg: dict, reps: int) -> dict:
    nxd_state.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    group = nxd_state.get_expert_model_parallel_group()
    router, experts = build(cfg, group=group)
    x = tokens(cfg, 10 + dist.get_rank())

    def step() -> None:
        xx = x.clone().requires_grad_(True)
        _, affinities, index = router(xx)
        experts(xx, affinities, index).sum().backward()

    seconds = _time(step, reps)
    with nxd_state.count_collectives() as counter:
        step()
    with torch.no_grad():
        _, _, index = router(x)
    ep, me = dist.get_world_size(), dist.get_rank()
    local = cfg["experts"] // ep
    remote_rows = int(((index // local) != me).sum())  # rows this rank sends away
    every = collectives.all_gather(index, group, dim=0).view(ep, -1)
    incoming = int(sum(((every[r] // local) == me).sum() for r in range(ep) if r != me))
    stats = counter.total(op="all_to_all")
    nxd_state.destroy_model_parallel()
    return {
        "seconds": seconds,
        "all_to_all_calls": stats.calls,
        "all_to_all_wire_bytes": stats.wire_bytes,
        "remote_rows": remote_rows,
        "incoming_rows": incoming,
        "all_gather_wire_bytes": counter.total(op="all_gather").wire_bytes,
    }


def replicated_step(cfg: dict, reps: int) -> dict:
    router, experts = build(cfg)
    x = tokens(cfg, 10 + dist.get_rank())
    params = [experts.gate_up_proj.weight, experts.down_proj.weight]

    def compute() -> None:
        xx = x.clone().requires_grad_(True)
        _, affinities, index = router(xx)
        experts(xx, affinities, index).sum().backward()

    def step() -> None:
        compute()
        for p in params:
            collectives.all_reduce(p.grad)
        for p in params:
            p.grad = None

    return {"seconds": _time(step, reps), "compute_only_seconds": _time(compute, reps)}


def dropped(cfg: dict, factors: list[float]) -> dict:
    out = {}
    x = tokens(cfg, 1)
    for factor in factors:
        router, experts = build(cfg, capacity_factor=factor)
        with torch.no_grad():
            _, affinities, index = router(x)
            experts(x, affinities, index)
        out[str(factor)] = experts.last_dropped / (cfg["tokens"] * cfg["top_k"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "experts": args.experts,
        "top_k": args.top_k,
    }
    ep = 2
    ep_ranks = run_distributed(ep_step, ep, cfg, args.reps)
    replicated = run_distributed(replicated_step, ep, cfg, args.reps)
    element = 4
    theory_each_way = cfg["tokens"] * cfg["top_k"] * cfg["hidden"] * (ep - 1) / ep * element
    result = {
        "config": {**cfg, "ep": ep, "dtype": "float32", "reps": args.reps},
        "loop_vs_bmm": loop_vs_bmm(cfg, args.reps),
        "ep2": {
            "seconds": max(r["seconds"] for r in ep_ranks),
            "per_rank": ep_ranks,
            "all_to_all_bytes_per_rank_per_step": [r["all_to_all_wire_bytes"] for r in ep_ranks],
            "theory_balanced_bytes_per_step": 4 * theory_each_way,
            "theory_balanced_bytes_each_way": theory_each_way,
            # Forward: dispatch sends the rows going away, combine returns the rows that came
            # in; backward: the same two volumes again (the reverse all-to-alls).
            "sent_rows_theory_bytes_per_step": [
                2 * (r["remote_rows"] + r["incoming_rows"]) * cfg["hidden"] * element
                for r in ep_ranks
            ],
        },
        "replicated": {
            "seconds": max(r["seconds"] for r in replicated),
            "compute_only_seconds": max(r["compute_only_seconds"] for r in replicated),
        },
        "dropped_fraction_per_capacity_factor": dropped(cfg, [0.5, 1.0, 1.25, 1.5, 2.0]),
    }
    result["ep2"]["over_replicated"] = result["ep2"]["seconds"] / result["replicated"]["seconds"]
    result["ep2"]["bytes_equal_sent_rows"] = (
        result["ep2"]["all_to_all_bytes_per_rank_per_step"]
        == result["ep2"]["sent_rows_theory_bytes_per_step"]
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
