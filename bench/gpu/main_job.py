"""nxd-train on one GPU: the main job at ~0.9B against a plain Hugging Face AMP +
torch.compile loop, and the feature sweep, in one call that writes JSON as it goes.

    python3 bench/gpu/main_job.py [--out DIR] [--budget-s 420] [--only main,peer-amp,...]
    .venv/bin/python bench/gpu/main_job.py --smoke        # here, on CPU, tiny sizes, a few minutes

On the GPU machine run it through ``bench/gpu/run.sh`` (installs the carried wheels first).

* **main**: ``nxd-train`` (the ``nxd_trainer.train`` command, one process, TP=1) trains a Llama
  of hidden 2048, 16 layers, 32 heads, 8 KV heads, SwiGLU 5632, vocabulary 32000 (0.85 B
  parameters; a ``config.json`` written here) on sequences of 2048 tokens, batch 4, with
  ``--bf16`` (bf16 parameters, fp32 master weights in AdamW) and ``--compile``, on the default
  corpus (the Python standard library's sources) with the run's own 32000-token BPE.
* **peer-amp**: the same model, config, batch and blocks (the main run's packed blocks) in a
  plain Hugging Face loop (``bench/gpu/peer.py``): fp32 weights, bf16 autocast, fused AdamW,
  ``torch.compile(model)``. Goal: nxd tokens/s >= 1.0x this loop's.
* **peer-bf16-master** (last, when the budget allows): the same loop with nxd's numerics (bf16
  weights, fp32 masters in fused AdamW, no autocast).
* **sweep** (``small`` preset, 1024 tokens x 8 sequences, no compile): fp32; fp32 with
  ``--grad-accum 4`` (same global batch: losses and gradient norms compared per step with the
  fp32 run); resume (half the steps, then the same command with all of them: the log must say
  "resumed" and the steps after the cut are compared with the fp32 run); bf16; bf16 + ZeRO-1
  (world 1: ZeRO-1 degenerates, but runs); bf16 + full and selective activation checkpointing;
  ``nxd-train export`` of the bf16 run; a LoRA (rank 8) fine-tune of that export. Each: ok or the
  error tail, tokens/s, the card's peak memory in use.

Timing: nxd-train's ``metrics.jsonl`` rows; a step's time is the interval between consecutive
rows' wall clock (``time``), so it holds everything the loop does; steps up to ``skip``
(compilation, allocator warm-up) are left out and the median of the rest is taken. nxd's own
``tokens_per_s`` (which leaves out the logging between steps) is reported beside it. The peer's
step time is the same interval in its loop. MFU: ``flops.py`` (6·N + 12·L·h·s per token over the
card's datasheet dense bf16 peak; the causal and weights-only counts beside it).

Memory: the launcher cannot see ``torch.cuda.max_memory_allocated`` of nxd-train's worker, so a
thread samples the card's memory in use through NVML (``pynvml``, else ``nvidia-smi``) every
0.1 s during each entry: the whole card, CUDA context and the caching allocator's reserve
included (an upper bound on what the tensors needed). The peer also reports its own
``max_memory_allocated``.

Budget: ``--budget-s`` bounds the whole run; an entry that cannot finish in what is left is
skipped (said in the JSON) and each has its own time limit (its process group is killed at the
limit, and whatever metrics it wrote are still read). The JSON (``--out``/gpu_bench.json) is
rewritten after every entry, so a call cut short still returns what was done; every
subprocess's output goes to ``bench.log`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from flops import count_parameters, flops_per_token, mfu, peak_bf16_tflops  # noqa: E402

GOALS = {"mfu_palm": 0.50, "ratio_vs_hf_amp_compile": 1.0}
# fp32 runs of the same global batches (grad accumulation, resume) differ only in the order of
# sums: on CPU the smoke run's losses and norms agree to ~1e-7 relative over every step; on the
# GPU cuBLAS may pick another reduction for another micro-batch size (~1e-6 per product, no TF32
# in fp32 by default), and 20 warm-up steps amplify that little: 1e-4 / 1e-3 leave two orders of
# margin while any real difference in the math (a wrong scale, a dropped micro-batch, a lost
# optimizer state) moves the loss or the norm by far more than 1e-3.
MATCH_TOLERANCE = {"loss_rel": 1e-4, "grad_norm_rel": 1e-3}


@dataclass(kw_only=True)
class Plan:
    """Sizes, steps and time limits of one bench run (``gpu()`` or ``smoke()``)."""

    device: str
    """``cuda``, or ``cpu`` for the smoke run."""
    main_model: dict[str, int]
    """The main job's Llama shape (written as its config.json)."""
    main_seq: int
    main_batch: int
    main_steps: int
    main_skip: int
    """Leading steps left out of the timing (compilation, warm-up)."""
    main_compile: bool
    bpe_vocab: int
    """Size of the byte-level BPE the main run trains (<= the model's vocabulary)."""
    corpus_mb: float
    sweep_model: str
    sweep_seq: int
    sweep_batch: int
    sweep_steps: int
    sweep_skip: int
    limits_s: dict[str, float] = field(default_factory=dict)
    """Per-entry time limit (s); an entry starts only when this much budget is left."""


def gpu_plan() -> Plan:
    return Plan(
        device="cuda",
        main_model={
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 5632,
            "vocab_size": 32000,
        },
        main_seq=2048,
        main_batch=4,
        main_steps=40,
        main_skip=10,
        main_compile=True,
        bpe_vocab=32000,
        corpus_mb=2.0,
        sweep_model="small",
        sweep_seq=1024,
        sweep_batch=8,
        sweep_steps=20,
        sweep_skip=5,
        limits_s={"probe": 60, "main": 210, "peer": 150, "sweep": 60, "export": 60},
    )


def smoke_plan() -> Plan:
    return Plan(
        device="cpu",
        main_model={
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 176,
            "vocab_size": 2048,
        },
        main_seq=64,
        main_batch=4,
        main_steps=6,
        main_skip=2,
        main_compile=False,
        bpe_vocab=2048,
        corpus_mb=0.5,
        sweep_model="tiny",
        sweep_seq=64,
        sweep_batch=8,
        sweep_steps=6,
        sweep_skip=2,
        limits_s={"probe": 120, "main": 300, "peer": 300, "sweep": 300, "export": 300},
    )


# --- memory --------------------------------------------------------------------------------
class CardMemory:
    """Peak memory in use on GPU 0 (MiB), sampled every 0.1 s in a thread: NVML through
    ``pynvml``, else ``nvidia-smi``, else nothing (``source`` says which)."""

    def __init__(self, enabled: bool) -> None:
        self._read: Any = None
        self.source = "none (CPU run)" if not enabled else "none (no pynvml, no nvidia-smi)"
        if not enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._read = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            self.source = "NVML memory in use (pynvml), whole card"
        except Exception:
            if shutil.which("nvidia-smi"):
                query = [
                    "nvidia-smi",
                    "--query-gpu=memory.used",
                    "--format=csv,noheader,nounits",
                    "--id=0",
                ]
                self._read = lambda: float(subprocess.check_output(query, text=True).split()[0])
                self.source = "nvidia-smi memory.used, whole card"

    def now(self) -> float | None:
        try:
            return self._read() if self._read else None
        except Exception:
            return None

    @contextmanager
    def peak(self) -> Iterator[dict[str, float | None]]:
        holder: dict[str, float | None] = {"peak_mib": None}
        if self._read is None:
            yield holder
            return
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                value = self.now()
                if value is not None and (holder["peak_mib"] is None or value > holder["peak_mib"]):
                    holder["peak_mib"] = value
                stop.wait(0.1)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield holder
        finally:
            stop.set()
            thread.join()


# --- running and reading -------------------------------------------------------------------
class Bench:
    """The results, the budget and the log of one run."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.plan = plan
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / "gpu_bench.json"
        self.log_path = self.out / "bench.log"
        self.log_path.write_text("")
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.work = Path(args.work) if args.work else _scratch(plan.device == "cuda")
        self.work.mkdir(parents=True, exist_ok=True)
        self.memory = CardMemory(plan.device == "cuda")
        self.results: dict[str, Any] = {
            "bench": "bench/gpu/main_job.py",
            "status": "running",
            "smoke": args.smoke,
            "budget_s": args.budget_s,
            "work_dir": str(self.work),
            "plan": asdict(plan),
            "goals": GOALS,
            "memory_source": self.memory.source,
            "timeline": [],
        }
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        self.env |= {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.results["elapsed_s"] = time.monotonic() - self.start
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        os.replace(tmp, self.json_path)

    def run(self, name: str, argv: list[str], limit_s: float) -> dict[str, Any]:
        """Run ``argv`` (its own process group, killed at the limit); rc, time, memory, tail
        (Python >= 3.11: ``process_group``; the GPU machine has 3.12)."""
        limit = min(limit_s, self.left())
        entry: dict[str, Any] = {"command": argv}
        if limit < 0.5 * limit_s:  # not enough budget left to be worth starting
            entry |= {
                "ok": False,
                "skipped": f"budget: {self.left():.0f} s left, < half of its {limit_s:.0f} s",
            }
            self._line(f"[{name}] skipped ({entry['skipped']})")
            return entry
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        self._line(f"[{name}] {' '.join(argv)}  (limit {limit:.0f} s)")
        with self.memory.peak() as peak, log.open("w") as handle:
            process = subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.work,
                # A process group of its own (killed whole at the limit), in this session: the
                # device tool ends a session's processes with the command, but not a new session.
                process_group=0,
            )
            try:
                rc = process.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                rc = process.wait()
                timed_out = True
        seconds = time.monotonic() - began
        text = log.read_text(errors="replace")
        with self.log_path.open("a") as handle:
            handle.write(f"\n===== {name} (rc {rc}, {seconds:.1f} s): {' '.join(argv)}\n{text}")
        entry |= {
            "rc": rc,
            "ok": rc == 0 and not timed_out,
            "timed_out": timed_out,
            "seconds": seconds,
            "peak_card_memory_mib": peak["peak_mib"],
        }
        if not entry["ok"]:
            entry["error_tail"] = text.splitlines()[-40:]
        self.results["timeline"].append(
            {
                "entry": name,
                "start_s": began - self.start,
                "seconds": seconds,
                "rc": rc,
                "timed_out": timed_out,
            }
        )
        self._line(f"[{name}] rc {rc}{' (timed out)' if timed_out else ''} in {seconds:.1f} s")
        return entry

    def _line(self, text: str) -> None:
        print(f"{time.monotonic() - self.start:7.1f}s {text}", flush=True)


def _scratch(gpu: bool) -> Path:
    """Where the runs go: RAM (/dev/shm) on the GPU machine when it has room for the main run's
    checkpoint (~12 GB: bf16 weights, fp32 masters and AdamW moments), else a temporary folder."""
    shm = Path("/dev/shm")
    if gpu and shm.is_dir() and shutil.disk_usage(shm).free > 40e9:
        return Path(tempfile.mkdtemp(prefix="nxd-gpu-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="nxd-gpu-bench-"))


def read_rows(run: Path) -> list[dict[str, Any]]:
    """The train rows of a run's metrics.jsonl (lines cut by a kill are skipped)."""
    path = run / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("kind") == "train":
                rows.append(row)
    return rows


def throughput(rows: list[dict[str, Any]], skip: int, tokens_per_step: int) -> dict[str, Any]:
    """Steady-state rates of nxd-train's rows: the wall-clock period between consecutive rows
    (steps > ``skip``) and nxd's own per-step ``tokens_per_s``; medians."""
    by_step = {r["step"]: r for r in rows}
    periods = [
        by_step[s]["time"] - by_step[s - 1]["time"]
        for s in sorted(by_step)
        if s > skip and s - 1 in by_step
    ]
    reported = [r["tokens_per_s"] for r in rows if r["step"] > skip]
    out: dict[str, Any] = {"steps_logged": len(rows), "steps_timed": len(periods)}
    if periods:
        median = statistics.median(periods)
        out |= {
            "step_ms_median": median * 1e3,
            "step_ms_min": min(periods) * 1e3,
            "tokens_per_s": tokens_per_step / median,
        }
    if reported:
        out["tokens_per_s_reported"] = statistics.median(reported)
    if rows:
        first = min(rows, key=lambda r: r["step"])
        out |= {
            "first_step_s": tokens_per_step / first["tokens_per_s"],
            "first_loss": first["loss"],
            "last_loss": rows[-1]["loss"],
        }
    return out


def compare_rows(a: list[dict[str, Any]], b: list[dict[str, Any]], steps: range) -> dict[str, Any]:
    """Per-step relative differences of loss and gradient norm between two runs."""
    ra, rb = {r["step"]: r for r in a}, {r["step"]: r for r in b}
    common = [s for s in steps if s in ra and s in rb]
    if not common:
        return {"steps_compared": 0, "within_tolerance": False}

    def rel(key: str, s: int) -> float:
        x, y = ra[s][key], rb[s][key]
        return abs(x - y) / max(abs(x), abs(y), 1e-12)

    loss_max = max(rel("loss", s) for s in common)
    norm_max = max(rel("grad_norm", s) for s in common)
    return {
        "steps_compared": len(common),
        "tolerance": MATCH_TOLERANCE,
        "within_tolerance": loss_max <= MATCH_TOLERANCE["loss_rel"]
        and norm_max <= MATCH_TOLERANCE["grad_norm_rel"],
        "loss_rel_max": loss_max,
        "grad_norm_rel_max": norm_max,
        "loss_rel_first": rel("loss", common[0]),
        "grad_norm_rel_first": rel("grad_norm", common[0]),
        "pairs": [
            [s, ra[s]["loss"], rb[s]["loss"], ra[s]["grad_norm"], rb[s]["grad_norm"]]
            for s in common
        ],
    }


# --- the entries ---------------------------------------------------------------------------
def nxd_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "nxd_trainer.train", *args]


def run_probe(bench: Bench) -> None:
    spec = {"role": "probe", "device": bench.plan.device, "result": str(bench.work / "probe.json")}
    path = bench.work / "probe.spec.json"
    path.write_text(json.dumps(spec))
    entry = bench.run(
        "probe", [sys.executable, str(HERE / "peer.py"), str(path)], bench.plan.limits_s["probe"]
    )
    info: dict[str, Any] = {"probe": entry}
    if entry.get("ok"):
        info |= json.loads(Path(spec["result"]).read_text())
    info["cpu_count"] = os.cpu_count()
    info["card_memory_in_use_before_mib"] = bench.memory.now()
    bench.results["environment"] = info
    bench.save()


def main_model(bench: Bench, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """Write the main job's config.json; its parameter counts and FLOPs per token."""
    import transformers

    plan = bench.plan
    config = transformers.LlamaConfig(
        **plan.main_model,
        max_position_embeddings=plan.main_seq,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    folder = bench.work / "model"
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    config.to_json_file(str(path))
    counts = count_parameters(config)
    flops = flops_per_token(
        counts["matmul"], config.num_hidden_layers, config.hidden_size, plan.main_seq
    )
    device_name = bench.results.get("environment", {}).get("device_name", "cpu")
    if args.peak_tflops:
        peak, matched = args.peak_tflops, "--peak-tflops"
    else:
        peak, matched = peak_bf16_tflops(device_name)
    info = {
        "config": plan.main_model,
        "parameters": counts,
        "flops_per_token": flops,
        "peak_bf16_tflops": peak,
        "peak_from": matched,
        "seq_len": plan.main_seq,
        "batch_size": plan.main_batch,
        "tokens_per_step": plan.main_seq * plan.main_batch,
    }
    return path, info


def run_main(bench: Bench, config: Path, name: str, compile: bool) -> dict[str, Any]:
    plan = bench.plan
    runs = bench.work / "runs"
    argv = nxd_argv(
        "--model", str(config), "--name", name, "--runs-dir", str(runs),
        "--device", plan.device, "--nproc-per-node", "1", "--tp", "1", "--bf16",
        "--compile" if compile else "--no-compile",
        "--seq-len", str(plan.main_seq), "--batch-size", str(plan.main_batch),
        "--steps", str(plan.main_steps), "--vocab-size", str(plan.bpe_vocab),
        "--corpus-mb", str(plan.corpus_mb), "--eval-every", "0", "--eval-batches", "1",
        "--save-every", str(10 * plan.main_steps), "--no-export", "--sample-tokens", "0",
        "--no-progress",
    )  # fmt: skip
    entry = bench.run(name, argv, plan.limits_s["main"])
    run = runs / name
    entry |= throughput(read_rows(run), plan.main_skip, plan.main_seq * plan.main_batch)
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        shutil.copy(metrics, bench.out / f"{name}_metrics.jsonl")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # ~12 GB, in RAM on the GPU machine
    return entry


def run_peer(bench: Bench, config: Path, numerics: str) -> dict[str, Any]:
    plan = bench.plan
    name = f"peer-{numerics}"
    data = bench.work / "runs" / "main" / "data"
    vocab = plan.main_model["vocab_size"]
    meta = data / "meta.json"
    if meta.is_file():
        vocab = json.loads(meta.read_text()).get("vocab", vocab)
    spec = {
        "role": "train",
        "numerics": numerics,
        "device": plan.device,
        "config": str(config),
        "blocks": str(data / "blocks.safetensors"),
        "vocab_size": vocab,
        "seed": 1234,
        "batch_size": plan.main_batch,
        "seq_len": plan.main_seq,
        "steps": plan.main_steps,
        "skip": plan.main_skip,
        "warmup_steps": 20,
        "lr": 3e-3,
        "compile": plan.main_compile,
        "result": str(bench.work / f"{name}.json"),
    }
    path = bench.work / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    entry = bench.run(
        name, [sys.executable, str(HERE / "peer.py"), str(path)], plan.limits_s["peer"]
    )
    if entry.get("ok"):
        entry |= json.loads(Path(spec["result"]).read_text())
    return entry


def summarize_main(bench: Bench) -> None:
    """Ratios and MFU of the main job from what has run so far."""
    main = bench.results["main_job"]
    model = main["model"]
    nxd = main.get("nxd", {})
    for key in ("peer_amp", "peer_bf16_master"):
        peer = main.get(key, {})
        if nxd.get("tokens_per_s") and peer.get("tokens_per_s"):
            main[f"ratio_vs_{key}"] = nxd["tokens_per_s"] / peer["tokens_per_s"]
    for key in ("nxd", "nxd_eager_after_compile_failed", "peer_amp", "peer_bf16_master"):
        side = main.get(key)
        if side is not None:
            side["mfu"] = mfu(
                model["flops_per_token"], side.get("tokens_per_s"), model["peak_bf16_tflops"]
            )
    measured = bench.results.get("environment", {}).get("measured_bf16_matmul_tflops")
    if measured and nxd.get("tokens_per_s"):
        nxd["share_of_measured_matmul_rate"] = mfu(
            model["flops_per_token"], nxd["tokens_per_s"], measured
        )
    ratio = main.get("ratio_vs_peer_amp")
    util = (nxd.get("mfu") or {}).get("palm")
    main["goals_met"] = {
        "mfu_palm >= 0.50": None if util is None else util >= GOALS["mfu_palm"],
        "ratio_vs_hf_amp_compile >= 1.0": None
        if ratio is None
        else ratio >= GOALS["ratio_vs_hf_amp_compile"],
    }
    bench.save()


class Sweep:
    """The feature sweep: nxd-train runs of the ``small`` preset sharing the main run's BPE."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.runs = bench.work / "sweep"
        self.tokenizer: Path | None = None
        main_tok = bench.work / "runs" / "main" / "tokenizer"
        if main_tok.is_dir():
            self.tokenizer = main_tok
        self.out: dict[str, Any] = {}
        bench.results["sweep"] = self.out

    def common(self, name: str, steps: int | None, own_tokenizer: bool) -> list[str]:
        plan = self.bench.plan
        total = plan.sweep_steps
        tok = (
            ["--tokenizer", str(self.tokenizer)]
            if self.tokenizer
            else ["--vocab-size", "8192" if plan.device == "cuda" else "2048"]
        )
        if own_tokenizer:
            tok = []
        # Warm-up covers every step: the LR of step s is then (s+1)/W whatever --steps is,
        # so a run cut at half and resumed follows the uninterrupted run exactly.
        return [
            "--name", name, "--runs-dir", str(self.runs), "--device", plan.device,
            "--nproc-per-node", "1", "--tp", "1", "--seq-len", str(plan.sweep_seq),
            "--batch-size", str(plan.sweep_batch), "--steps", str(steps or total),
            "--warmup-steps", str(total), "--corpus-mb", str(plan.corpus_mb),
            "--eval-every", "0", "--eval-batches", "1", "--save-every", str(10 * total),
            "--sample-tokens", "0", "--no-progress", *tok,
        ]  # fmt: skip

    def train(
        self,
        name: str,
        extra: list[str],
        *,
        model: bool = True,
        steps: int | None = None,
        key: str | None = None,
        skip: int | None = None,
    ) -> dict[str, Any]:
        """One nxd-train run of the sweep; ``skip``: steps left out of the timing."""
        plan = self.bench.plan
        argv = nxd_argv(
            *self.common(name, steps, "--tokenizer" in extra),
            *(["--model", plan.sweep_model] if model else []),
            *extra,
        )
        if "--export" not in extra:
            argv.append("--no-export")
        entry = self.bench.run(f"sweep-{key or name}", argv, plan.limits_s["sweep"])
        entry |= throughput(
            read_rows(self.runs / name),
            plan.sweep_skip if skip is None else skip,
            plan.sweep_seq * plan.sweep_batch,
        )
        if self.tokenizer is None and (self.runs / name / "tokenizer").is_dir():
            self.tokenizer = self.runs / name / "tokenizer"
        self.out[key or name] = entry
        self.bench.save()
        return entry

    def run(self) -> None:
        plan, runs = self.bench.plan, self.runs
        steps = plan.sweep_steps
        half = steps // 2
        self.train("fp32", [])
        accum = self.train("fp32_accum4", ["--grad-accum", "4"])
        # Same global batch (the loader's order does not depend on accumulation): the mean
        # loss and the gradient of each step are the same sums taken in another order.
        accum["vs_fp32"] = compare_rows(
            read_rows(runs / "fp32"), read_rows(runs / "fp32_accum4"), range(1, steps + 1)
        )
        self.bench.save()
        first = self.train("resume", [], steps=half, key="resume_first_half")
        if first.get("ok"):
            # Timed from the second step after the cut (the first spans the two launches).
            second = self.train("resume", [], key="resume", skip=max(half + 1, plan.sweep_skip))
            log = (self.bench.work / "logs" / "sweep-resume.log").read_text(errors="replace")
            second["log_says_resumed"] = "resumed from" in log
            second["first_half_s"] = first.get("seconds")
            second["vs_fp32_after_resume"] = compare_rows(
                read_rows(runs / "fp32"), read_rows(runs / "resume"), range(half + 1, steps + 1)
            )
            self.bench.save()
        self.train("bf16", ["--bf16"])
        self.train("bf16_zero1", ["--bf16", "--zero1"])
        self.train("bf16_ac_full", ["--bf16", "--activation-checkpointing", "full"])
        self.train("bf16_ac_selective", ["--bf16", "--activation-checkpointing", "selective"])
        self.export()
        exported = runs / "bf16" / "hf"
        if (exported / "config.json").is_file():
            lora = self.train(
                "lora", ["--model", str(exported), "--tokenizer", str(exported), "--lora-rank",
                         "8", "--bf16", "--export"], model=False, key="lora_of_export",
            )  # fmt: skip
            lora["merged_export_written"] = (runs / "lora" / "hf" / "config.json").is_file()
        else:
            self.out["lora_of_export"] = {"ok": False, "skipped": "no export to fine-tune"}
        self.bench.save()

    def export(self) -> None:
        run = self.runs / "bf16"
        entry = self.bench.run(
            "sweep-export", nxd_argv("export", str(run), "--sample-tokens", "16"),
            self.bench.plan.limits_s["export"],
        )  # fmt: skip
        hf = run / "hf"
        if hf.is_dir():
            entry["files"] = {p.name: p.stat().st_size for p in sorted(hf.iterdir()) if p.is_file()}
        if entry.get("ok"):
            log = (self.bench.work / "logs" / "sweep-export.log").read_text(errors="replace")
            lines = log.splitlines()
            at = next((i for i, t in enumerate(lines) if t.startswith("nxd-train: exported")), -1)
            entry["exported_line"] = lines[at] if at >= 0 else None
            # The sample: what follows the weights' loading bar.
            sample = [t for t in lines[at + 1 :] if not t.startswith("Loading weights")]
            entry["sample"] = "\n".join(sample)
        self.out["export"] = entry
        self.bench.save()


def table(bench: Bench) -> str:
    """The short table printed last (the device tool returns the end of the output)."""
    lines = []
    env = bench.results.get("environment", {})
    lines.append(
        f"card: {env.get('device_name')}  torch {env.get('torch')}  "
        f"transformers {env.get('transformers')}  measured bf16 matmul "
        f"{_fmt(env.get('measured_bf16_matmul_tflops'))} TFLOP/s"
    )
    main = bench.results.get("main_job", {})
    for key in ("nxd", "nxd_eager_after_compile_failed", "peer_amp", "peer_bf16_master"):
        side = main.get(key)
        if side:
            util = (side.get("mfu") or {}).get("palm")
            lines.append(
                f"main {key} ok={side.get('ok')} tokens/s={_fmt(side.get('tokens_per_s'))}"
                f" step_ms={_fmt(side.get('step_ms_median'))} mfu={_fmt(util, 3)}"
                f" mem={_fmt(side.get('peak_card_memory_mib'))}MiB"
            )
    for key in ("ratio_vs_peer_amp", "ratio_vs_peer_bf16_master"):
        if key in main:
            lines.append(f"main {key}: {main[key]:.3f}")
    if "goals_met" in main:
        lines.append(f"goals: {main['goals_met']}")
    for key, entry in bench.results.get("sweep", {}).items():
        extra = ""
        for name in ("vs_fp32", "vs_fp32_after_resume"):
            if name in entry:
                c = entry[name]
                extra = (
                    f" {name}: loss_rel_max={_fmt(c.get('loss_rel_max'), 2)}"
                    f" gnorm_rel_max={_fmt(c.get('grad_norm_rel_max'), 2)}"
                )
        if "log_says_resumed" in entry:
            extra += f" resumed={entry['log_says_resumed']}"
        lines.append(
            f"sweep {key:22s} ok={entry.get('ok')} tokens/s={_fmt(entry.get('tokens_per_s'))}"
            f" mem={_fmt(entry.get('peak_card_memory_mib'))}MiB"
            f"{' ' + entry['skipped'] if 'skipped' in entry else ''}{extra}"
        )
    return "\n".join(lines)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}e}" if 0 < abs(value) < 1e-2 else f"{value:,.{digits}f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=str(ROOT / "bench" / "results" / "gpu"),
        help="folder of gpu_bench.json, bench.log, main_metrics.jsonl",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="the whole run's time budget (entries that do not fit are skipped)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (proves the script)")
    parser.add_argument(
        "--only",
        default="main,peer-amp,sweep,peer-bf16-master",
        help="comma-separated entries to run, in this order",
    )
    parser.add_argument("--work", help="scratch folder of the runs (default: /dev/shm or /tmp)")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch folder")
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak (TFLOP/s)")
    args = parser.parse_args()
    if args.smoke and args.budget_s == 420.0:
        args.budget_s = 3600.0
    plan = smoke_plan() if args.smoke else gpu_plan()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - {"main", "peer-amp", "sweep", "peer-bf16-master"}
    if unknown:
        parser.error(f"--only: unknown entries {sorted(unknown)}")
    bench = Bench(args, plan)
    try:
        run_probe(bench)
        config, model = main_model(bench, args)
        bench.results["main_job"] = {"model": model}
        bench.save()
        main = bench.results["main_job"]
        for item in only:
            if item == "main":
                nxd = main["nxd"] = run_main(bench, config, "main", plan.main_compile)
                failed = not nxd.get("ok") and not nxd.get("timed_out") and "skipped" not in nxd
                if failed and plan.main_compile:  # the eager figure, to tell compile apart
                    main["nxd_eager_after_compile_failed"] = run_main(
                        bench, config, "main_eager", False
                    )
            elif item == "peer-amp":
                main["peer_amp"] = run_peer(bench, config, "amp")
            elif item == "peer-bf16-master":
                main["peer_bf16_master"] = run_peer(bench, config, "bf16-master")
            else:
                Sweep(bench).run()
            summarize_main(bench)
        bench.results["status"] = "done"
    except BaseException as error:
        bench.results["status"] = f"failed: {type(error).__name__}: {error}"
        raise
    finally:
        bench.save()
        print(table(bench), flush=True)
        print(f"results: {bench.json_path}", flush=True)
        if not args.keep_work:
            shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()
