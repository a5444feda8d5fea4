"""Checkpoint throughput: nxd-ckpt vs a raw write of the same bytes vs torch.distributed.checkpoint.

One process holds a model (Linear layers) and its AdamW state (after one step: exp_avg,
exp_avg_sq). Every round, in rotating order, on the same state:

* ``raw``: the state's bytes copied (untimed) into one buffer, then one Python ``write`` of it
  (timed: ``raw_write_s``, into the page cache) and one ``fsync`` (``raw_fsync_s``): the floor
  for writing those bytes to this disk; ``raw2``: the same bytes written by 2 threads
  (``os.pwrite`` of each half) then one ``fsync``: whether more writer threads per rank help;
* ``nxd``: ``nxd_ckpt.save_checkpoint`` (sync), and ``load_checkpoint`` into the same model
  and optimizer;
* ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` of the model and optimizer state
  dicts (its FileSystemWriter fsyncs too);
* diagnostics (not valid checkpoints, never loaded): ``nxd_nocrc``, the nxd save with the
  CRC-32s replaced by zeros (is the CRC on the critical path?), and ``nxd_nodirsync``,
  without the four small folder/index fsyncs (what does their count cost?).

Each artefact is deleted right after it is measured (peak disk use about twice the state).
Then the async saves, on the same state:

* ``async_save=True`` (``async_copy="before_return"``, the default): the first save allocates
  the host buffer (``blocked_cold``, and the peak extra resident memory while it runs); the
  next reuses it, as a training loop's later saves do (``blocked``);
* ``async_copy="before_step"``: the call returns before copying parameters and optimizer
  state, and the next ``optimizer.step()`` waits for the copy: ``blocked_before_step`` is the
  call alone (a loop whose next step comes after a forward and backward long enough for
  the copy), ``blocked_before_step_immediate`` the call plus an ``optimizer.step()`` made at
  once (the worst case: the step waits for the whole copy);
* the loop: an async save in each mode followed by a training step (forward and backward of
  64 rows, ``optimizer.step()``); ``loop_blocked`` is the call plus the time that step waited
  for a deferred copy (the step gate's own count). The background write also competes with
  training for the cores while it runs; that slowdown is not counted as blocked time.

``raw_write_speed_vs_dcp`` is the ceiling for ``save_speed_vs_dcp``: no save that makes the
same bytes durable can beat one ``write`` + ``fsync`` of them by much.

Ratios are taken per round (same disk state for both sides) and their medians reported with
quartiles; throughput counts the bytes of the state. Loads read files that were just written
(page cache hot for every reader alike). The load average (1 min) is recorded per round.
Reshard: a 2-rank TP=2 save of a TP model loaded into TP=1 (1 rank) vs the same-degree TP=2
load, both timed in the loading ranks.

Goals (from the issue; recorded in ``goals``, never asserted): save >= 0.8x raw and >= 1.5x
DCP; async blocked <= 0.1x the sync save; peak extra host memory during an async save
<= 1.1x the rank's state bytes.

    .venv/bin/python bench/checkpoint.py [--mb 256] [--rounds 5] [--dir /tmp]

Writes bench/results/checkpoint.json and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
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
LOOP_BATCH = 64  # rows per training step in the loop measurement


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


def _raw_buffer(model: nn.Module, optimizer: torch.optim.Optimizer) -> memoryview:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])  # untimed copy
    return memoryview(buffer.numpy())


def _raw_write(path: Path, view: memoryview, threads: int) -> tuple[float, float]:
    """(write seconds, fsync seconds) of ``view`` written by ``threads`` threads."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def part(begin: int, end: int) -> None:
        while begin < end:
            begin += os.pwrite(fd, view[begin:end], begin)

    bounds = [len(view) * i // threads for i in range(threads + 1)]
    workers = [threading.Thread(target=part, args=bounds[i : i + 2]) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    written = time.perf_counter()
    os.fsync(fd)
    os.close(fd)
    synced = time.perf_counter()
    path.unlink()
    return written - start, synced - written


@contextlib.contextmanager
def _diagnostic(kind: str) -> Any:
    """nxd-ckpt with one cost removed (the files are not valid checkpoints): ``nocrc``, the
    CRC-32s replaced by zeros; ``nodirsync``, only the data file fsynced (no folder, index
    or ``done`` fsyncs)."""
    from nxd_ckpt.format import _crc, _stfile, _tags
    from nxd_ckpt.save import _saver, _write

    real_atomic = _stfile.write_text_atomic

    def zeros(data: memoryview, block: int, scalar: bool) -> list[int]:
        return [0] * max(1, -(-len(data) // max(block, 1)))

    def not_durable(path: Path, text: str, *, durable: bool = True) -> None:
        real_atomic(path, text, durable=False)

    patches: dict[tuple[Any, str], Any] = {}
    if kind == "nocrc":
        patches[(_crc, "block_crcs")] = zeros
    else:
        replacements = {"fsync_dir": lambda path: None, "write_text_atomic": not_durable}
        for module in (_stfile, _tags, _saver, _write):
            for name, value in replacements.items():
                if hasattr(module, name):
                    patches[(module, name)] = value
    saved = {key: getattr(*key) for key in patches}
    for (module, name), value in patches.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


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

    out: dict[str, float] = {"load_avg_1min_start": os.getloadavg()[0]}
    work = folder / f"round{index}"
    work.mkdir()
    steps = ["raw", "nxd", "dcp", "raw2", "nxd_nocrc", "nxd_nodirsync"]
    steps = steps[index % len(steps) :] + steps[: index % len(steps)]  # who goes first rotates
    view = _raw_buffer(model, optimizer)

    def dcp_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def nxd_save(name: str = "nxd") -> None:
        nxd_ckpt.save_checkpoint(work / name, "t", model=model, optimizer=optimizer)

    for step in steps:
        if step in ("raw", "raw2"):
            write, sync = _raw_write(work / "raw.bin", view, 1 if step == "raw" else 2)
            out[f"{step}_write_s"], out[f"{step}_fsync_s"] = write, sync
            out[f"{step}_save_s"] = write + sync
        elif step == "nxd":
            out["nxd_save_s"] = _timed(nxd_save)
            load = lambda: nxd_ckpt.load_checkpoint(  # noqa: E731
                work / "nxd", "t", model=model, optimizer=optimizer
            )
            out["nxd_load_s"] = _timed(load)
            shutil.rmtree(work / "nxd")
        elif step == "dcp":
            out["dcp_save_s"] = _timed(lambda: dcp.save(dcp_state(), checkpoint_id=str(work / "d")))
            out["dcp_load_s"] = _timed(lambda: dcp.load(dcp_state(), checkpoint_id=str(work / "d")))
            shutil.rmtree(work / "d")
        else:
            with _diagnostic(step.removeprefix("nxd_")):
                out[f"{step}_save_s"] = _timed(lambda step=step: nxd_save(step))
            shutil.rmtree(work / step)

    def async_save(tag: str, copy: str = "before_return") -> None:
        nxd_ckpt.save_checkpoint(
            work / "async", tag, model=model, optimizer=optimizer, async_save=True, async_copy=copy
        )

    def wait() -> None:
        nxd_ckpt.finalize_checkpoint(release_host_memory=False)
        shutil.rmtree(work / "async")

    nxd_ckpt.finalize_checkpoint()  # the host buffer of earlier rounds is freed
    with _PeakRss() as memory:  # the first async save allocates its host buffer
        cold = _timed(lambda: async_save("cold"))
        total = cold + _timed(wait)
    warm = _timed(lambda: async_save("warm"))  # a training loop's later saves reuse it
    wait()
    start = time.perf_counter()
    async_save("deferred_step", "before_step")
    call = time.perf_counter() - start
    optimizer.step()  # no gradients: changes nothing, but waits for the copy as any step does
    immediate = time.perf_counter() - start
    wait()
    loop = _loop_blocked(model, optimizer, async_save, wait)
    out.update(
        async_blocked_cold_s=cold,
        async_blocked_s=warm,
        async_total_s=total,
        async_peak_extra_bytes=memory.extra,
        async_blocked_before_step_s=call,
        async_blocked_before_step_immediate_s=immediate,
        **loop,
        load_avg_1min_end=os.getloadavg()[0],
    )
    shutil.rmtree(work)
    return out


def _loop_blocked(model: nn.Module, optimizer: Any, async_save: Any, wait: Any) -> dict:
    """A training step (forward and backward of ``LOOP_BATCH`` rows, ``optimizer.step()``) right
    after an async save in each mode: the loop is blocked for the call plus whatever the
    step waited at the step gate for a deferred copy (measured by the gate itself)."""
    import nxd_ckpt

    batch = torch.randn(LOOP_BATCH, HIDDEN)
    out = {}
    for copy in ("before_return", "before_step"):
        waited = nxd_ckpt.async_copy_waited_s()
        start = time.perf_counter()
        async_save(f"loop_{copy}", copy)
        call = time.perf_counter() - start
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out[f"loop_step_s_{copy}"] = time.perf_counter() - start - call
        out[f"loop_blocked_{copy}_s"] = call + nxd_ckpt.async_copy_waited_s() - waited
        wait()
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
        for name in ("raw_save", "raw2_save", "nxd_save", "dcp_save", "nxd_load", "dcp_load")
    }
    save_vs_raw = ratio("raw_save_s", "nxd_save_s")  # > 1: nxd faster
    save_vs_dcp = ratio("dcp_save_s", "nxd_save_s")
    load_vs_dcp = ratio("dcp_load_s", "nxd_load_s")
    blocked = ratio("async_blocked_s", "nxd_save_s")
    blocked_cold = ratio("async_blocked_cold_s", "nxd_save_s")
    before_step = ratio("async_blocked_before_step_s", "nxd_save_s")
    loop_return = ratio("loop_blocked_before_return_s", "nxd_save_s")
    loop_step = ratio("loop_blocked_before_step_s", "nxd_save_s")
    before_step_now = ratio("async_blocked_before_step_immediate_s", "nxd_save_s")
    peak = _quartiles([r["async_peak_extra_bytes"] / state_bytes for r in rounds])
    result = {
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        "load_avg_1min": _quartiles([r["load_avg_1min_start"] for r in rounds]),
        "throughput_GBps": gbs,
        "save_speed_vs_raw_write": save_vs_raw,
        "save_speed_vs_dcp": save_vs_dcp,
        "raw_write_speed_vs_dcp": ratio("dcp_save_s", "raw_save_s"),
        "load_speed_vs_dcp": load_vs_dcp,
        "breakdown": {
            "raw_fsync_share_of_raw_save": _quartiles(
                [r["raw_fsync_s"] / r["raw_save_s"] for r in rounds]
            ),
            "raw_2_threads_speed_vs_1": ratio("raw_save_s", "raw2_save_s"),
            "nxd_without_crc_speed_vs_nxd": ratio("nxd_save_s", "nxd_nocrc_save_s"),
            "nxd_without_small_fsyncs_speed_vs_nxd": ratio("nxd_save_s", "nxd_nodirsync_save_s"),
        },
        "async_blocked_over_sync_save": blocked,
        "async_blocked_first_save_over_sync_save": blocked_cold,
        "async_before_step_blocked_over_sync_save": before_step,
        "async_before_step_immediate_step_blocked_over_sync_save": before_step_now,
        "loop_step_s": _quartiles([r["loop_step_s_before_step"] for r in rounds]),
        "loop_blocked_over_sync_save": {"before_return": loop_return, "before_step": loop_step},
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
            "async_blocked_vs_sync <= 0.1 (before_return)": blocked["median"] <= 0.1,
            "async_blocked_vs_sync <= 0.1 (before_step, call)": before_step["median"] <= 0.1,
            "async_blocked_vs_sync <= 0.1 (before_step, immediate step)": (
                before_step_now["median"] <= 0.1
            ),
            "loop_blocked_vs_sync <= 0.1 (before_return)": loop_return["median"] <= 0.1,
            "loop_blocked_vs_sync <= 0.1 (before_step)": loop_step["median"] <= 0.1,
            "async_peak_extra_memory <= 1.1x state": peak["median"] <= 1.1,
        },
        "per_round": rounds,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=2))


if __name__ == "__main__":
    main()
