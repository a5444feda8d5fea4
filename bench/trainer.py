"""The trainer's overheads: host memory of meta-device init, and step time of the wrapper.

1. **Meta-init memory.** Each rank of a TP x PP layout builds a TinyLM whose every large
   weight is sharded (vocabulary-parallel embedding and head, column/row-parallel blocks)
   through ``initialize_parallel_model`` with ``meta_device_init``; the peak resident memory
   added during the call (``VmHWM`` after resetting it, minus ``VmRSS`` before) is compared with
   the model's fp32 bytes / (TP·PP), the rank's share (goal <= 1.1x). Eager init (the full
   model built on every rank, then sliced or cut) is measured the same way, for contrast.
2. **Step time.** The same model and optimizer are trained by hand (nxd's TP layers, and
   ``NxDPPModel`` at PP=2, with ``nxd_optim.NxDOptimizer``) and through
   ``initialize_parallel_model`` / ``initialize_parallel_optimizer``, round-robin (one step of
   each per round, after a barrier) so machine noise hits both alike; the median of the
   per-round ratios wrapped / by hand is reported with quartiles (goal <= 1.02x).

    uv run python bench/trainer.py [--rounds 30]

Writes bench/results/trainer.json and prints it.
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

from nxd_state.testing import add_preload, run_distributed

logger = logging.getLogger("bench.trainer")
RESULTS = Path(__file__).parent / "results" / "trainer.json"
MEMORY_MODEL = {"vocab": 8192, "hidden": 512, "layers": 8, "heads": 8}
STEP_MODEL = {"vocab": 2048, "hidden": 256, "layers": 4, "heads": 4}
BATCH, SEQ = 8, 64


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


@torch.no_grad()
def _init(module: torch.nn.Module) -> None:
    """A param_init_fn that works on the local shard in place (no full-size temporaries)."""
    for name, param in module.named_parameters(recurse=False):
        if isinstance(module, torch.nn.LayerNorm):
            param.fill_(1.0 if name == "weight" else 0.0)
        else:
            param.normal_(0.0, 0.02)


def _model(**kwargs: Any) -> torch.nn.Module:
    from nxd_trainer.testing import TinyLM

    return TinyLM(tensor_parallel=True, **kwargs)


def memory_rank(tp: int, pp: int, meta: bool) -> dict[str, Any]:
    import nxd_trainer as nxd
    from nxd_trainer.testing import Block

    pipeline = None
    if pp > 1:
        layers = MEMORY_MODEL["layers"]
        pipeline = {
            "transformer_layer_cls": Block,
            "pipeline_cuts": [f"blocks.{layers // pp * (k + 1) - 1}" for k in range(pp - 1)],
            "leaf_module_cls": ["Embed", "Head"],
        }
    init = {"meta_device_init": True, "param_init_fn": _init} if meta else {}
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline,
        model_init_config=init,
    )
    # Warm-up on a tiny model of the same shape family: lazy imports, tracing machinery and
    # allocator pools are then in place, so the measurement sees the model being built.
    tiny = {**MEMORY_MODEL, "vocab": 64, "hidden": 32, "heads": 4}
    tiny_model = nxd.initialize_parallel_model(config, _model, **tiny)
    del tiny_model
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    model = nxd.initialize_parallel_model(config, _model, **MEMORY_MODEL)
    peak = _status_kib("VmHWM")
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"added_peak_bytes": (peak - before) * 1024, "local_param_bytes": local_bytes}


def _full_model_bytes() -> int:
    from nxd_trainer.testing import TinyLM

    with torch.device("meta"):
        model = TinyLM(**MEMORY_MODEL)
    return sum(p.numel() * 4 for p in model.parameters())


def _by_hand(pp: int) -> tuple[Any, Any, Any]:
    """(step function, model, optimizer) built without the trainer."""
    from nxd_optim import NxDOptimizer, OptimizerConfig
    from nxd_pipeline import NxDPPModel
    from nxd_trainer.testing import Block, Embed, Head

    model = _model(**STEP_MODEL)
    if pp > 1:
        model = NxDPPModel(
            model,
            transformer_layer_cls=Block,
            leaf_module_cls=[Embed, Head],
            num_microbatches=2,
            pipeline_cuts=["blocks.1"],
            use_zero1_optimizer=True,  # the optimizer wrapper averages over DP
        )
        params = list(model.local_parameters())
    else:
        params = list(model.parameters())
    optimizer = NxDOptimizer(params, torch.optim.AdamW, config=OptimizerConfig(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        if pp > 1:
            model.run_train(input_ids=ids, labels=ids)
        else:
            model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, model, optimizer


def _wrapped(pp: int) -> Any:
    import nxd_trainer as nxd
    from nxd_trainer.testing import Block

    pipeline = None
    if pp > 1:
        pipeline = {
            "transformer_layer_cls": Block,
            "leaf_module_cls": ["Embed", "Head"],
            "num_microbatches": 2,
            "pipeline_cuts": ["blocks.1"],
        }
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=dist.get_world_size() // pp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline,
    )
    model = nxd.initialize_parallel_model(config, _model, **STEP_MODEL)
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.AdamW, model.parameters(), lr=1e-4
    )

    def step(ids: torch.Tensor) -> None:
        model.run_train(ids, ids)
        optimizer.step()
        optimizer.zero_grad()

    return step


def step_rank(pp: int, rounds: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    wrapped = _wrapped(pp)  # initialises model parallelism
    by_hand, _, _ = _by_hand(pp)
    ids = torch.randint(0, STEP_MODEL["vocab"], (BATCH, SEQ))
    times: dict[str, list[float]] = {"wrapped": [], "by_hand": []}
    for i in range(warmup + rounds):
        order = [("wrapped", wrapped), ("by_hand", by_hand)]
        if i % 2:
            order.reverse()  # neither always runs first
        for name, step in order:
            dist.barrier()
            start = time.perf_counter()
            step(ids)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def _ratios(mine: list[float], theirs: list[float]) -> dict[str, Any]:
    ratios = sorted(a / b for a, b in zip(mine, theirs))
    q = statistics.quantiles(ratios, n=4)
    return {
        "median": statistics.median(ratios),
        "q1": q[0],
        "q3": q[2],
        "share_at_or_below_1": sum(r <= 1 for r in ratios) / len(ratios),
        "wrapped_median_s": statistics.median(mine),
        "by_hand_median_s": statistics.median(theirs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["memory", "step"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    add_preload("nxd_trainer", "nxd_optim", "nxd_pipeline", "torch._dynamo")
    full = _full_model_bytes()
    memory = []
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2)] if "memory" in args.parts else []
    for tp, pp in layouts:
        for meta in (True, False):
            ranks = run_distributed(memory_rank, tp * pp, tp, pp, meta, timeout=900)
            share = full / (tp * pp)
            worst = max(r["added_peak_bytes"] for r in ranks)
            entry = {
                "tp": tp,
                "pp": pp,
                "init": "meta" if meta else "eager",
                "model_bytes": full,
                "share_bytes": share,
                "max_added_peak_bytes": worst,
                "ratio_to_share": worst / share,
                "local_param_bytes": [r["local_param_bytes"] for r in ranks],
            }
            logger.info("memory %s", json.dumps(entry))
            memory.append(entry)
    steps = {}
    for name, pp in (("tp2", 1), ("pp2", 2)) if "step" in args.parts else ():
        ranks = run_distributed(step_rank, 2, pp, args.rounds, args.warmup, timeout=900)
        steps[name] = _ratios(ranks[0]["wrapped"], ranks[0]["by_hand"])
        logger.info("step %s %s", name, json.dumps(steps[name]))
    document = {
        "machine": {"cpus": torch.get_num_threads(), "torch": torch.__version__},
        "memory_model": MEMORY_MODEL,
        "step_model": {**STEP_MODEL, "batch": BATCH, "seq": SEQ},
        "memory": memory,
        "step_time": steps,
        "goals": {
            "meta_init_peak_per_rank_vs_share_le_1.1": bool(memory)
            and all(m["ratio_to_share"] <= 1.1 for m in memory if m["init"] == "meta"),
            "wrapped_step_vs_by_hand_le_1.02": bool(steps)
            and all(s["median"] <= 1.02 for s in steps.values()),
        },
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(document, indent=2))
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
