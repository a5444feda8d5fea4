"""Inference tracing: latency of the loaded traced model vs the eager TP model, same run.

    .venv/bin/python bench/trace.py [--calls 40] [--tp 2] [--aoti]

The Llama-style LM of bench/tp_layers.py (logits gathered by the head) is served at TP=2 by
TP workers in three forms, all in this run, all through the same worker pool and pipes:

* eager: each worker runs the nn.Module that ``func()`` built (no capture);
* loaded: ``parallel_model_trace`` -> ``parallel_model_save`` -> ``parallel_model_load`` (each
  worker runs its ``torch.export`` program, collectives in the graph);
* with ``--aoti``: the same, compiled by AOTInductor (``compiler_args={"aot_inductor": True}``).

Calls of the compared models alternate (order rotated every round), so machine noise hits all
alike. Reported per model: the median end-to-end call (caller to caller: inputs out, rank 0's
logits back) and the median forward time measured inside rank 0 (``last_compute_seconds``),
with ratios to eager; also the trace / save / load / compile times and the largest output
difference to eager. JSON in bench/results/trace.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from nxd_layers import ColumnParallelLinear
from nxd_layers.trace import (
    TensorParallelModel,
    parallel_model_load,
    parallel_model_save,
    parallel_model_trace,
)

logger = logging.getLogger("bench.trace")
RESULTS = Path(__file__).parent / "results" / "trace.json"


def _tp_layers() -> Any:
    """bench/tp_layers.py (its Config and model), loaded by path (bench is not a package)."""
    name = "bench_tp_layers"
    if name not in sys.modules:
        path = Path(__file__).with_name("tp_layers.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def lm(config: dict[str, int]) -> tuple[torch.nn.Module, None]:
    """``func`` for every form: the benchmark LM, its head gathering the logits."""
    tp_layers = _tp_layers()
    cfg = tp_layers.Config(**config)
    model = tp_layers.nxd_model(cfg)
    model.head = ColumnParallelLinear(cfg.hidden, cfg.vocab, bias=False, gather_output=True)
    return model, None


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def measure(
    models: dict[str, TensorParallelModel], ids: torch.Tensor, calls: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """End-to-end and rank-0 compute seconds per call, the models' calls alternating."""
    names = list(models)
    times: dict[str, dict[str, list[float]]] = {n: {"call": [], "compute": []} for n in names}
    for round_ in range(warmup + calls):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            _, seconds = _timed(lambda n=name: models[n](ids))
            if round_ >= warmup:
                times[name]["call"].append(seconds)
                times[name]["compute"].append(models[name].last_compute_seconds or 0.0)
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--aoti", action="store_true", help="also compile with AOTInductor")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = _tp_layers().Config()
    func = functools.partial(lm, asdict(cfg))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=generator)
    seconds: dict[str, float] = {}
    models: dict[str, TensorParallelModel] = {}
    with tempfile.TemporaryDirectory(prefix="nxd-bench-trace-") as tmp:
        try:
            logger.info("eager TP=%d workers", args.tp)
            models["eager"], seconds["eager_build"] = _timed(
                lambda: parallel_model_trace(func, ids, tp_degree=args.tp, _eager=True)
            )
            logger.info("trace, save, load")
            traced, seconds["trace"] = _timed(
                lambda: parallel_model_trace(func, ids, tp_degree=args.tp)
            )
            _, seconds["save"] = _timed(lambda: parallel_model_save(traced, Path(tmp) / "export"))
            traced.close()
            models["loaded"], seconds["load"] = _timed(
                lambda: parallel_model_load(Path(tmp) / "export")
            )
            if args.aoti:
                logger.info("AOTInductor: trace + compile, save, load")
                compiled, seconds["aoti_trace_and_compile"] = _timed(
                    lambda: parallel_model_trace(
                        func,
                        ids,
                        compiler_workdir=Path(tmp) / "aoti-work",
                        compiler_args={"aot_inductor": True},
                        tp_degree=args.tp,
                    )
                )
                parallel_model_save(compiled, Path(tmp) / "aoti")
                compiled.close()
                models["loaded_aoti"], seconds["aoti_load"] = _timed(
                    lambda: parallel_model_load(Path(tmp) / "aoti")
                )
            reference = models["eager"](ids)
            max_diff = {n: float((m(ids) - reference).abs().max()) for n, m in models.items()}
            logger.info("timing %d calls per model (after %d warm-up)", args.calls, args.warmup)
            times = measure(models, ids, args.calls, args.warmup)
        finally:
            for model in models.values():
                model.close()
    medians = {
        name: {kind: round(statistics.median(v) * 1e3, 3) for kind, v in t.items()}
        for name, t in times.items()
    }
    result = {
        "benchmark": "trace",
        "config": asdict(cfg),
        "tp_degree": args.tp,
        "calls": args.calls,
        "torch": torch.__version__,
        "median_ms": medians,
        "ratio_to_eager": {
            name: {
                kind: round(medians[name][kind] / medians["eager"][kind], 3)
                for kind in ("call", "compute")
            }
            for name in medians
            if name != "eager"
        },
        "max_abs_diff_to_eager": max_diff,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
