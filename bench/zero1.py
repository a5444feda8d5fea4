"""ZeRO-1 step time, memory and traffic: nxd's NeuronZero1Optimizer vs
torch.distributed.optim.ZeroRedundancyOptimizer vs plain data parallelism (gloo, CPU).

Every configuration trains its own copy of the same model in the same process group,
round-robin (one step of each per round, after a barrier, in an order shuffled every round,
the same on every rank), so machine noise hits all of them alike; the step time of nxd's
ZeRO-1 is compared with torch's *in the same round* (median of the paired ratios, quartiles,
share of rounds at or below 1). Configurations:

* ``nxd_zero1``: NeuronZero1Optimizer with its defaults (clipping to 1.0; on gloo the
  gradients are all-reduced and sliced at DP=2 and reduce-scattered, by an all-to-all and a
  local sum, from DP=3; params are views of the flat buffer the all-gather fills in place, by
  n broadcasts on gloo);
* ``nxd_zero1_other_reduction``: the same with the gradient reduction ``auto`` does not pick
  (reduce-scatter at DP=2, all-reduce from DP=3), to show the choice;
* ``nxd_zero1_copies``: the default with ``parameters_as_bucket_view=False`` (gather into a
  temporary with gloo's all-gather, then copy into the params: what ran before the views);
* ``torch_zero``: ZeroRedundancyOptimizer, gradients averaged by an all-reduce beforehand (as
  DDP would) and clipped to 1.0 with ``torch.nn.utils.clip_grad_norm_``: the same math;
* ``*_noclip``: nxd ZeRO-1 and torch ZeRO without clipping (torch ZeRO's own default);
* ``nxd_dp``: nxd's plain data parallelism (replicated AdamW), for reference.

Besides wall time, each rank records the CPU time of its whole process during the step
(``time.process_time``: the Python thread and gloo's worker threads), whose paired ratio is
far less sensitive to other jobs on the machine than wall time; the goal is on wall time.
Per rank it also records optimizer-state bytes (AdamW exp_avg + exp_avg_sq + step) vs the full
state / n, and collective wire bytes per step under nxd_state's ring model vs the ZeRO theory
2(n-1)/n·Ψ (Ψ = parameter bytes); torch's own broadcasts are counted with the bytes gloo's
binomial tree sends from each rank (nxd's gather is n such broadcasts, which nxd_state counts
as the (n-1)·Ψ/n per rank they send).
``goals`` records the issue's targets per DP size: median step-time ratio vs torch <= 1.0
(with and without clipping) and optimizer state per rank 1.00 x full/DP.

    .venv/bin/python bench/zero1.py [--sizes 2 4] [--rounds 100]

Writes bench/results/zero1.json and prints it.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nxd_state.testing import add_preload, run_distributed

logger = logging.getLogger("bench.zero1")
RESULTS = Path(__file__).parent / "results" / "zero1.json"
MAX_NORM = 1.0
CONFIGS = (
    "nxd_zero1",
    "torch_zero",
    "nxd_zero1_other_reduction",
    "nxd_zero1_copies",
    "nxd_zero1_noclip",
    "torch_zero_noclip",
    "nxd_dp",
)
PAIRS = {"nxd_zero1": "torch_zero", "nxd_zero1_noclip": "torch_zero_noclip"}
VARIANTS = ("nxd_zero1_other_reduction", "nxd_zero1_copies")  # each vs nxd_zero1, same round


def _model() -> nn.Module:
    # Unequal parameter sizes (262k, 1k, 262k, 256, 65k, 256): a per-parameter partition cannot
    # balance them, a flat split can.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(), nn.Linear(256, 256)
    )


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def _binomial_tree_sends(rank: int, root: int, n: int) -> int:
    """How many times group rank ``rank`` sends the buffer in gloo's binomial-tree broadcast
    from group rank ``root`` (gloo/broadcast.cc). With v = rank - root mod n, round i = 0, 1, …
    involves the v whose bits above i are zero; one with bit i clear sends to v + 2^i if that
    rank exists. Every non-root receives once, so the n ranks send n-1 times in all."""
    v, sends, dim = (rank - root) % n, 0, max(1, (n - 1).bit_length())
    mask = (1 << dim) - 1
    for i in range(dim):
        mask ^= 1 << i
        if v & mask or (v ^ (1 << i)) >= n:
            continue
        sends += (v & (1 << i)) == 0
    return sends


class _BroadcastTally:
    """Counts torch's own dist.broadcast calls (ZeroRedundancyOptimizer bypasses nxd_state)
    with the bytes gloo's binomial tree really sends from this rank: B times its children in
    the tree (over every root, n-1 per rank; the root alone sends ceil(log2 n) times). Calls are
    only noted during the timed step; the bytes are worked out afterwards."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.calls: list[tuple[int, int, Any]] = []  # (bytes, src, group)
        self.enabled = enabled
        self._original = dist.broadcast

    def __enter__(self) -> _BroadcastTally:
        if not self.enabled:
            return self

        def counted(tensor: torch.Tensor, src: int, group: Any = None, **kwargs: Any) -> Any:
            self.calls.append((tensor.numel() * tensor.element_size(), src, group))
            return self._original(tensor, src, group, **kwargs)

        dist.broadcast = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.broadcast = self._original

    @property
    def wire_bytes(self) -> float:
        total = 0
        for nbytes, src, group in self.calls:
            ranks = dist.get_process_group_ranks(group or dist.GroupMember.WORLD)
            me, root = ranks.index(dist.get_rank()), ranks.index(src)
            total += _binomial_tree_sends(me, root, len(ranks)) * nbytes
        return float(total)


def _build(kind: str, model: nn.Module, dp_group: Any) -> Any:
    """The optimizer of configuration ``kind`` and its timed step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from nxd_optim import NeuronZero1Optimizer, NxDOptimizer, OptimizerConfig
    from nxd_optim._zero1_comm import GLOO_REDUCE_SCATTER_MIN_RANKS
    from nxd_state import collectives

    params = list(model.parameters())
    clip = not kind.endswith("_noclip")
    if kind.startswith("nxd_zero1"):
        reduction = "auto"
        if kind.endswith("other_reduction"):
            dp = dist.get_world_size(dp_group)
            reduction = "reduce_scatter" if dp < GLOO_REDUCE_SCATTER_MIN_RANKS else "all_reduce"
        optimizer: Any = NeuronZero1Optimizer(
            params,
            torch.optim.AdamW,
            lr=1e-3,
            grad_clipping=clip,
            max_norm=MAX_NORM,
            grad_reduction=reduction,
            parameters_as_bucket_view=not kind.endswith("copies"),
        )
        return optimizer, optimizer.step
    if kind == "nxd_dp":
        optimizer = NxDOptimizer(params, torch.optim.AdamW, config=OptimizerConfig(), lr=1e-3)
        return optimizer, optimizer.step
    if kind.startswith("torch_zero"):
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)

        def step() -> None:  # ZeRO leaves gradient averaging to DDP: one bucketed all-reduce
            collectives.all_reduce_bucketed([p.grad for p in params], dp_group, average=True)
            if clip:
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()

        return optimizer, step
    raise ValueError(f"unknown configuration {kind!r}; expected one of {CONFIGS}")


def bench_rank(rounds: int, warmup: int) -> dict[str, Any]:
    import nxd_state

    state = nxd_state.initialize_model_parallel()
    reference = _model()
    psi = sum(p.numel() * p.element_size() for p in reference.parameters())
    runs = {}
    for kind in CONFIGS:
        model = copy.deepcopy(reference)
        optimizer, step = _build(kind, model, state.data_parallel_group)
        runs[kind] = {"model": model, "optimizer": optimizer, "step": step}
    times: dict[str, list[float]] = {kind: [] for kind in CONFIGS}
    cpu: dict[str, list[float]] = {kind: [] for kind in CONFIGS}
    wire: dict[str, float] = dict.fromkeys(CONFIGS, 0.0)
    calls: dict[str, int] = dict.fromkeys(CONFIGS, 0)
    gen = torch.Generator().manual_seed(state.rank)
    for round_index in range(warmup + rounds):
        x = torch.randn(8, 256, generator=gen)
        order = random.Random(round_index).sample(CONFIGS, len(CONFIGS))  # same on every rank
        for kind in order:
            run = runs[kind]
            run["optimizer"].zero_grad()
            run["model"](x).pow(2).mean().backward()
            dist.barrier()
            # torch's ZeRO broadcasts outside nxd_state; nxd's own broadcasts (its gloo
            # all-gather) are counted by nxd_state as the all-gather they are
            tally = _BroadcastTally(enabled=kind.startswith("torch"))
            with nxd_state.count_collectives() as counter, tally:
                start, start_cpu = time.perf_counter(), time.process_time()
                run["step"]()
                elapsed = time.perf_counter() - start
                elapsed_cpu = time.process_time() - start_cpu
            if round_index >= warmup:
                times[kind].append(elapsed)
                cpu[kind].append(elapsed_cpu)
                wire[kind] += counter.total().wire_bytes + tally.wire_bytes
                calls[kind] += counter.total().calls + len(tally.calls)
    full = torch.optim.AdamW(_model().parameters(), lr=1e-3)  # one step: the full AdamW state
    for p in full.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    full.step()
    out: dict[str, Any] = {"param_bytes": psi, "full_state_bytes": _state_bytes(full)}
    for kind, run in runs.items():
        optimizer = run["optimizer"]
        if kind.startswith("nxd_zero1"):
            local = optimizer.state_nbytes(include_master=False)
            master = optimizer.state_nbytes() - local
        elif kind == "nxd_dp":
            local, master = _state_bytes(optimizer.optimizer), 0
        else:
            local, master = _state_bytes(optimizer.optim), 0
        out[kind] = {
            "state_bytes": local,
            "master_shard_bytes": master,
            "wire_bytes_per_step": wire[kind] / rounds,
            "collective_calls_per_step": calls[kind] / rounds,
            "step_s": times[kind],
            "cpu_s": cpu[kind],
        }
    return out


def _ratios(mine: list[float], theirs: list[float]) -> dict[str, Any]:
    """Per-round ratios of the slowest rank's step times (both ran back to back)."""
    ratios = sorted(a / b for a, b in zip(mine, theirs, strict=True))
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "median": statistics.median(ratios),
        "quartiles": [quartiles[0], quartiles[2]],
        "rounds_at_or_below_1": sum(r <= 1.0 for r in ratios) / len(ratios),
    }


def summarize(n: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    full, psi = ranks[0]["full_state_bytes"], ranks[0]["param_bytes"]
    theory = 2 * (n - 1) / n * psi
    rows: dict[str, Any] = {}
    slowest: dict[str, list[float]] = {}
    cpu_total: dict[str, list[float]] = {}
    for kind in CONFIGS:
        per_rank = [r[kind] for r in ranks]
        # a step ends when its slowest rank finishes: per round, the max over ranks
        slowest[kind] = [max(times) for times in zip(*(r["step_s"] for r in per_rank))]
        # the CPU work of a step: every rank's process time, summed
        cpu_total[kind] = [sum(times) for times in zip(*(r["cpu_s"] for r in per_rank))]
        worst_state = max(r["state_bytes"] for r in per_rank)
        rows[kind] = {
            "state_bytes_per_rank": [r["state_bytes"] for r in per_rank],
            "state_max_over_full_div_dp": worst_state / (full / n),
            "master_shard_bytes_per_rank": [r["master_shard_bytes"] for r in per_rank],
            "wire_bytes_per_step_per_rank": [r["wire_bytes_per_step"] for r in per_rank],
            "wire_max_over_theory": max(r["wire_bytes_per_step"] for r in per_rank) / theory,
            "collective_calls_per_step": per_rank[0]["collective_calls_per_step"],
            "step_ms_median_slowest_rank": 1e3 * statistics.median(slowest[kind]),
            "step_ms_quartiles_slowest_rank": [
                1e3 * q for q in statistics.quantiles(slowest[kind], n=4)[::2]
            ],
            "cpu_ms_median_all_ranks": 1e3 * statistics.median(cpu_total[kind]),
        }
    for mine, peer in PAIRS.items():
        rows[mine]["step_ratio_vs_torch"] = {"peer": peer, **_ratios(slowest[mine], slowest[peer])}
        rows[mine]["cpu_ratio_vs_torch"] = _ratios(cpu_total[mine], cpu_total[peer])
    for variant in VARIANTS:
        rows[variant]["step_ratio_vs_nxd_zero1"] = _ratios(slowest[variant], slowest["nxd_zero1"])
        rows[variant]["cpu_ratio_vs_nxd_zero1"] = _ratios(
            cpu_total[variant], cpu_total["nxd_zero1"]
        )
    state_ratio = rows["nxd_zero1"]["state_max_over_full_div_dp"]
    goals = {
        "step_time_at_or_below_torch_zero": {
            "met": rows["nxd_zero1"]["step_ratio_vs_torch"]["median"] <= 1.0,
            "median_ratio": rows["nxd_zero1"]["step_ratio_vs_torch"]["median"],
            "quartiles": rows["nxd_zero1"]["step_ratio_vs_torch"]["quartiles"],
        },
        "step_time_at_or_below_torch_zero_noclip": {
            "met": rows["nxd_zero1_noclip"]["step_ratio_vs_torch"]["median"] <= 1.0,
            "median_ratio": rows["nxd_zero1_noclip"]["step_ratio_vs_torch"]["median"],
            "quartiles": rows["nxd_zero1_noclip"]["step_ratio_vs_torch"]["quartiles"],
        },
        "state_per_rank_1.00_of_full_div_dp": {
            "met": round(state_ratio, 2) == 1.00,
            "ratio": state_ratio,
        },
    }
    return {
        "dp": n,
        "param_bytes": psi,
        "full_state_bytes": full,
        "wire_theory_2psi_bytes": theory,
        "goals": goals,
        "configs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # creating a torch optimizer imports torch._dynamo: once in the forkserver, not per rank
    add_preload("torch._dynamo", "torch.distributed.optim", "nxd_optim")
    load_before = os.getloadavg()
    results = []
    for n in args.sizes:
        logger.info("dp=%d: %d configurations x %d rounds ...", n, len(CONFIGS), args.rounds)
        per_rank = run_distributed(bench_rank, n, args.rounds, args.warmup, timeout=900)
        results.append(summarize(n, per_rank))
        goals = results[-1]["goals"]
        logger.info("dp=%d goals: %s", n, json.dumps(goals))
    document = {
        "benchmark": "zero1",
        "model": "MLP 256-1024-256-256 (fp32, 591k params), AdamW, batch 8 per rank",
        "backend": "gloo, CPU, one intra-op thread per rank",
        "torch": torch.__version__,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "results": results,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(document, indent=2))
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
