"""ZeRO-1 memory and traffic: nxd's NeuronZero1Optimizer vs plain data parallelism vs
torch.distributed.optim.ZeroRedundancyOptimizer, side by side on the same model (gloo, CPU).

Per data-parallel size n it records, per rank:
* optimizer-state bytes (AdamW exp_avg + exp_avg_sq + step) vs the full state / n;
* collective wire bytes per step under the ring model of nxd_state's counter, vs the ZeRO
  theory 2(n-1)/n · Ψ (reduce-scatter the gradients, all-gather the parameters; Ψ = parameter
  bytes), which plain DP's all-reduce also moves;
* the optimizer step time (median over steps, slowest rank), which on 2 shared CPU cores says
  little beyond "same order".

    .venv/bin/python bench/zero1.py [--sizes 2 4] [--steps 8]

Writes bench/results/zero1.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import logging
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


class _BroadcastTally:
    """Counts torch's own dist.broadcast calls (ZeroRedundancyOptimizer bypasses nxd_state)
    with nxd_state's rule: a broadcast costs its bytes on the source rank."""

    def __init__(self) -> None:
        self.wire_bytes = 0.0
        self.calls = 0
        self._original = dist.broadcast

    def __enter__(self) -> _BroadcastTally:
        def counted(tensor: torch.Tensor, src: int, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if dist.get_rank() == src:
                self.wire_bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, src, *args, **kwargs)

        dist.broadcast = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.broadcast = self._original


def bench_rank(kind: str, steps: int, warmup: int) -> dict[str, Any]:
    import nxd_state
    from nxd_optim import NeuronZero1Optimizer, NxDOptimizer, OptimizerConfig
    from nxd_optim._grad_sync import all_reduce_bucketed

    state = nxd_state.initialize_model_parallel()
    dp_group = state.data_parallel_group
    model = _model()
    params = list(model.parameters())
    psi = sum(p.numel() * p.element_size() for p in params)
    reference = torch.optim.AdamW(_model().parameters(), lr=1e-3)  # for the full state size
    if kind == "nxd_zero1":
        optimizer: Any = NeuronZero1Optimizer(params, torch.optim.AdamW, lr=1e-3, max_norm=1.0)
    elif kind == "nxd_dp":
        optimizer = NxDOptimizer(params, torch.optim.AdamW, config=OptimizerConfig(), lr=1e-3)
    elif kind == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        raise ValueError(f"unknown kind {kind!r}; expected nxd_zero1, nxd_dp or torch_zero")

    times, wire, calls = [], 0.0, 0
    gen = torch.Generator().manual_seed(state.rank)
    for step in range(warmup + steps):
        x = torch.randn(8, 256, generator=gen)
        model(x).pow(2).mean().backward()
        with nxd_state.count_collectives() as counter, _BroadcastTally() as tally:
            start = time.perf_counter()
            if kind == "torch_zero":  # torch's ZeRO leaves gradient averaging to DDP: do it here
                all_reduce_bucketed([p.grad for p in params], dp_group, average=True)
            optimizer.step()
            elapsed = time.perf_counter() - start
        optimizer.zero_grad()
        if step >= warmup:
            times.append(elapsed)
            wire += counter.total().wire_bytes + tally.wire_bytes
            calls += counter.total().calls + tally.calls
    for p in reference.param_groups[0]["params"]:  # one step creates the full AdamW state
        p.grad = torch.zeros_like(p)
    reference.step()
    if kind == "nxd_zero1":
        local_state = optimizer.state_nbytes(include_master=False)
        master = optimizer.state_nbytes() - local_state
    elif kind == "nxd_dp":
        local_state, master = _state_bytes(optimizer.optimizer), 0
    else:
        local_state, master = _state_bytes(optimizer.optim), 0
    return {
        "state_bytes": local_state,
        "master_shard_bytes": master,
        "full_state_bytes": _state_bytes(reference),
        "param_bytes": psi,
        "wire_bytes_per_step": wire / steps,
        "collective_calls_per_step": calls / steps,
        "step_s": statistics.median(times),
    }


def summarize(kind: str, n: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    full = ranks[0]["full_state_bytes"]
    psi = ranks[0]["param_bytes"]
    theory = 2 * (n - 1) / n * psi
    worst_state = max(r["state_bytes"] for r in ranks)
    worst_wire = max(r["wire_bytes_per_step"] for r in ranks)
    return {
        "optimizer": kind,
        "dp": n,
        "param_bytes": psi,
        "full_state_bytes": full,
        "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
        "state_max_over_full_div_dp": worst_state / (full / n),
        "master_shard_bytes_per_rank": [r["master_shard_bytes"] for r in ranks],
        "wire_bytes_per_step_per_rank": [r["wire_bytes_per_step"] for r in ranks],
        "wire_theory_2psi_bytes": theory,
        "wire_max_over_theory": worst_wire / theory,
        "collective_calls_per_step": ranks[0]["collective_calls_per_step"],
        "step_ms_median_slowest_rank": 1e3 * max(r["step_s"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # creating a torch optimizer imports torch._dynamo: once in the forkserver, not per rank
    add_preload("torch._dynamo", "torch.distributed.optim", "nxd_optim")
    rows = []
    for n in args.sizes:
        for kind in ("nxd_zero1", "torch_zero", "nxd_dp"):
            logger.info("dp=%d %s ...", n, kind)
            rows.append(
                summarize(kind, n, run_distributed(bench_rank, n, kind, args.steps, args.warmup))
            )
    for n in args.sizes:  # ratios against nxd's ZeRO-1 at the same size
        same = {row["optimizer"]: row for row in rows if row["dp"] == n}
        for row in same.values():
            base = same["nxd_zero1"]
            row["step_time_vs_nxd_zero1"] = (
                row["step_ms_median_slowest_rank"] / base["step_ms_median_slowest_rank"]
            )
            row["max_state_vs_nxd_zero1"] = max(row["state_bytes_per_rank"]) / max(
                base["state_bytes_per_rank"]
            )
    document = {
        "benchmark": "zero1",
        "model": "MLP 256-1024-256-256 (fp32, 590k params), AdamW, batch 8 per rank",
        "backend": "gloo, CPU",
        "torch": torch.__version__,
        "steps": args.steps,
        "results": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(document, indent=2))
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
