"""Checkpoint throughput: nxd-ckpt vs a raw write of the same bytes vs torch.distributed.checkpoint.

One process holds a model (Linear layers) and its AdamW state (after one step: exp_avg,
exp_avg_sq). Every round, in rotating order, on the same state:

* ``raw``: the state's bytes copied (untimed) into one buffer, then one Python ``write`` +
  ``fsync`` of it: the floor for writing those bytes to this disk;
* ``nxd``: ``nxd_ckpt.save_checkpoint`` (sync), and ``load_checkpoint`` into the same model
  and optimizer;
* ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` of the model and optimizer state
  dicts (its FileSystemWriter fsyncs too);
* ``nxd_async``: ``save_checkpoint(async_save=True)``: the time the caller is blocked (the
  host copy), then waiting for the write; peak extra resident memory while the first save
  runs (it allocates the host buffer: ``blocked_cold``), and the blocked time of the next
  save, which reuses the buffer as a training loop's later saves do (``blocked``).

Ratios are taken per round (same disk state for both sides) and their medians reported with
quartiles; throughput counts the bytes of the state. Loads read files that were just written
(page cache hot for every reader alike). Reshard: a 2-rank TP=2 save of a TP model loaded
into TP=1 (1 rank) vs the same-degree TP=2 load, both timed in the loading ranks.

Goals (from the issue; recorded in ``goals``, never asserted): save >= 0.8x raw and >= 1.5x
DCP; async blocked <= 0.1x the sync save; peak extra host memory during an async save
<= 1.1x the rank's state bytes.

    .venv/bin/python bench/checkpoint.py [--mb 256] [--rounds 5] [--dir /tmp]

Writes bench/results/checkpoint.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxd_state.testing import run_distributed

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
HIDDEN = 1024


def _model(mb: float) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """Linear layers whose parameters + AdamW state take about ``mb`` MiB."""
    layers = max(1, round(mb * 2**20 / (3 * 4 * (HIDDEN * HIDDEN + HIDDEN))))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, HIDDEN)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tensors = [*model.parameters()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    return model, optimizer, sum(t.numel() * t.element_size() for t in tensors)


def _raw_write(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])  # untimed copy
    view = memoryview(buffer.numpy())
    path = folder / "raw.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - start


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples the resident set every millisecond while active."""

    def __enter__(self) -> _PeakRss:
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _round(folder: Path, model: nn.Module, optimizer: Any, index: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    import nxd_ckpt

    out: dict[str, float] = {}
    work = folder / f"round{index}"
    work.mkdir()
    steps = ["raw", "nxd", "dcp"]
    steps = steps[index % 3 :] + steps[: index % 3]  # rotate who goes first

    def dcp_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def nxd_save() -> None:
        nxd_ckpt.save_checkpoint(work / "nxd", "t", model=model, optimizer=optimizer)

    def nxd_load() -> None:
        nxd_ckpt.load_checkpoint(work / "nxd", "t", model=model, optimizer=optimizer)

    def dcp_save() -> None:
        dcp.save(dcp_state(), checkpoint_id=str(work / "dcp"))

    def dcp_load() -> None:
        dcp.load(dcp_state(), checkpoint_id=str(work / "dcp"))

    for step in steps:
        if step == "raw":
            out["raw_save_s"] = _raw_write(work, model, optimizer)
        elif step == "nxd":
            out["nxd_save_s"], out["nxd_load_s"] = _timed(nxd_save), _timed(nxd_load)
        else:
            out["dcp_save_s"], out["dcp_load_s"] = _timed(dcp_save), _timed(dcp_load)

    def async_save(tag: str) -> None:
        nxd_ckpt.save_checkpoint(
            work / "async", tag, model=model, optimizer=optimizer, async_save=True
        )

    def wait() -> None:
        nxd_ckpt.finalize_checkpoint(release_host_memory=False)

    nxd_ckpt.finalize_checkpoint()  # the host buffer of earlier rounds is freed
    with _PeakRss() as memory:  # the first async save allocates its host buffer
        cold = _timed(lambda: async_save("cold"))
        total = cold + _timed(wait)
    warm = _timed(lambda: async_save("warm"))  # a training loop's later saves reuse it
    wait()
    out.update(
        async_blocked_cold_s=cold,
        async_blocked_s=warm,
        async_total_s=total,
        async_peak_extra_bytes=memory.extra,
    )
    shutil.rmtree(work)
    return out


def _quartiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "q1": q[0], "q3": q[2]}


def reshard_rank(folder: str, layers: int, mode: str) -> float:
    """TP layers; ``save`` at TP=2, or time a load (``same``: TP=2, ``reshard``: TP=1)."""
    import nxd_ckpt
    import nxd_state
    from nxd_layers import ColumnParallelLinear, RowParallelLinear

    tp = 1 if mode == "reshard" else 2
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [
            ColumnParallelLinear(HIDDEN, 2 * HIDDEN, gather_output=False),
            RowParallelLinear(2 * HIDDEN, HIDDEN, input_is_parallel=True),
        ]
    model = nn.Sequential(*blocks)
    if mode == "save":
        nxd_ckpt.save_checkpoint(folder, "tp2", model=model)
        return 0.0
    torch.distributed.barrier()
    return _timed(lambda: nxd_ckpt.load_checkpoint(folder, "tp2", model=model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=256.0, help="model + optimizer state, MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    model, optimizer, state_bytes = _model(args.mb)
    root = Path(tempfile.mkdtemp(prefix="nxd-ckpt-bench-", dir=args.dir))
    try:
        _round(root, model, optimizer, -1)  # warm-up (imports, page cache, allocator)
        rounds = [_round(root, model, optimizer, i) for i in range(args.rounds)]
        layers = max(1, round(args.mb * 2**20 / (4 * 4 * HIDDEN * HIDDEN) / 3))
        run_distributed(reshard_rank, 2, str(root / "tp"), layers, "save")
        same = statistics.median(
            max(run_distributed(reshard_rank, 2, str(root / "tp"), layers, "same"))
            for _ in range(3)
        )
        reshard = statistics.median(
            run_distributed(reshard_rank, 1, str(root / "tp"), layers, "reshard")[0]
            for _ in range(3)
        )
        reshard_bytes = layers * 2 * 4 * (2 * HIDDEN * HIDDEN) + layers * 4 * (3 * HIDDEN)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def ratio(a: str, b: str) -> dict[str, float]:
        return _quartiles([r[a] / r[b] for r in rounds])

    gbs = {
        name: _quartiles([state_bytes / r[f"{name}_s"] / 1e9 for r in rounds])
        for name in ("raw_save", "nxd_save", "dcp_save", "nxd_load", "dcp_load")
    }
    save_vs_raw = ratio("raw_save_s", "nxd_save_s")  # > 1: nxd faster
    save_vs_dcp = ratio("dcp_save_s", "nxd_save_s")
    load_vs_dcp = ratio("dcp_load_s", "nxd_load_s")
    blocked = ratio("async_blocked_s", "nxd_save_s")
    blocked_cold = ratio("async_blocked_cold_s", "nxd_save_s")
    peak = _quartiles([r["async_peak_extra_bytes"] / state_bytes for r in rounds])
    result = {
        "device": "cpu",
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        "throughput_GBps": gbs,
        "save_speed_vs_raw_write": save_vs_raw,
        "save_speed_vs_dcp": save_vs_dcp,
        "load_speed_vs_dcp": load_vs_dcp,
        "async_blocked_over_sync_save": blocked,
        "async_blocked_first_save_over_sync_save": blocked_cold,
        "async_peak_extra_memory_over_state": peak,
        "reshard_load": {
            "bytes": reshard_bytes,
            "tp2_to_tp1_s": reshard,
            "tp2_to_tp2_s": same,
            "tp2_to_tp1_GBps": reshard_bytes / reshard / 1e9,
        },
        "goals": {
            "save_vs_raw >= 0.8": save_vs_raw["median"] >= 0.8,
            "save_vs_dcp >= 1.5": save_vs_dcp["median"] >= 1.5,
            "async_blocked_vs_sync <= 0.1": blocked["median"] <= 0.1,
            "async_peak_extra_memory <= 1.1x state": peak["median"] <= 1.1,
        },
        "per_round": rounds,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=2))


if __name__ == "__main__":
    main()
