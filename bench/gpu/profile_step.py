"""Where a step of the main job goes on a GPU: nxd-train's own ``Trainer`` under the profiler.

The main job's model (hidden 2048, 16 layers, 0.85B parameters; ``main_job.py``'s config) and
settings (TP=1, ``--bf16``: bf16 weights with fp32 masters and fp32 gradient accumulation,
``--compile``: each decoder layer compiled), batch 4 x 2048, random token ids (the speed does
not depend on them). After ``--warmup`` steps (compilation), ``--steps`` steps are timed by
the wall clock, then ``--profile-steps`` more run under ``torch.profiler``. Reported per step:

* wall time, and the GPU's busy time (the union of its kernels' intervals): busy / wall < 1
  means the GPU waited for the host (launches, a host sync);
* device time by kind of kernel: matrix products, attention, the optimizer's (multi-tensor
  AdamW, master copies), other elementwise work (compiled Triton kernels, casts), copies,
  communication; and the 25 kernels that took longest in total.

    python3 bench/gpu/profile_step.py --out DIR            # on the GPU (run.sh's site)
    .venv/bin/python bench/gpu/profile_step.py --smoke     # here: CPU, tiny model, no compile

Writes ``DIR/profile_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from main_job import gpu_plan  # noqa: E402  (bench/gpu is not a package)

KINDS = (  # (kind, substrings of a kernel's name), the first that matches
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "sm90", "cublas", "matmul")),
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy")),
    ("triton", ("triton",)),
)


class _Vocabulary:
    """The tokenizer's part the trainer reads: its size (no special ids)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other elementwise"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def device_kernels(prof: Any) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every device activity (kernels, copies) the profiler saw:
    from Kineto's raw events where this torch exposes them, else from its function events."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    out = []
    if raw is not None:
        for event in raw.events():
            if getattr(event.device_type(), "name", "") != "CUDA":
                continue
            start = event.start_ns() / 1e3
            out.append((event.name(), start, start + event.duration_ns() / 1e3))
        return out
    for event in prof.events():
        if getattr(event.device_type, "name", "") == "CUDA":
            out.append((event.name, event.time_range.start, event.time_range.end))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for profile_step.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model (proves the script)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out or os.environ.get("OUT") or HERE.parent / "results")
    out.mkdir(parents=True, exist_ok=True)

    import nxd_state
    from nxd_trainer.train.config import TrainConfig
    from nxd_trainer.train.rundir import RunDir
    from nxd_trainer.train.trainer import Trainer

    plan = gpu_plan()
    shape = dict(plan.main_model)
    seq, batch, device = plan.main_seq, plan.main_batch, "cuda"
    if args.smoke:
        shape.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=512)  # fmt: skip
        seq, batch, device = 32, 2, "cpu"
        args.warmup, args.steps, args.profile_steps = 2, 2, 1
    work = Path(tempfile.mkdtemp(prefix="nxd-profile-"))
    config_path = work / "config.json"
    config_path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "max_position_embeddings": seq, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        **shape,
    }))  # fmt: skip
    steps = args.warmup + args.steps + args.profile_steps
    cfg = TrainConfig(
        name="profile", runs_dir=str(work), model=str(config_path), device=device, tp=1,
        bf16=True, compile=not args.smoke, seq_len=seq, batch_size=batch, steps=steps,
        eval_every=0, export=False, sample_tokens=0, progress=False,
    )  # fmt: skip
    nxd_state.init_distributed(device_type=device)
    vocab = int(shape["vocab_size"])
    blocks = torch.randint(0, vocab, (64, seq), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(cfg, RunDir.of(cfg), (_Vocabulary(vocab), blocks, blocks[:batch]))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        trainer.train_step()
    sync()
    walls = []
    for _ in range(args.steps):
        started = time.perf_counter()
        trainer.train_step()  # ends with the step's one host sync (the loss read back)
        walls.append(time.perf_counter() - started)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            trainer.train_step()
        sync()
    profiled_wall_us = (time.perf_counter() - started) * 1e6
    kernels = device_kernels(prof)
    per_kind: dict[str, float] = {}
    per_name: dict[str, float] = {}
    for name, start, end in kernels:
        per_kind[kind_of(name)] = per_kind.get(kind_of(name), 0.0) + (end - start)
        per_name[name] = per_name.get(name, 0.0) + (end - start)
    n = args.profile_steps
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:25]
    step_ms = statistics.median(walls) * 1e3
    result = {
        "bench": "bench/gpu/profile_step.py",
        "smoke": args.smoke,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": shape,
        "seq_len": seq,
        "batch_size": batch,
        "step_ms_median": step_ms,
        "step_ms_all": [w * 1e3 for w in walls],
        "tokens_per_s": batch * seq / (step_ms / 1e3),
        "profiled_step_ms": profiled_wall_us / n / 1e3,
        "gpu_busy_ms_per_step": busy_us([(s, e) for _, s, e in kernels]) / n / 1e3,
        "kernels_per_step": len(kernels) / n,
        "device_ms_per_step_by_kind": {k: v / n / 1e3 for k, v in sorted(per_kind.items())},
        "top_kernels_ms_per_step": [[name[:160], v / n / 1e3] for name, v in top],
        "cpu_ops_table": prof.key_averages().table(sort_by="cpu_time_total", row_limit=25),
    }
    (out / "profile_step.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "cpu_ops_table"}, indent=1))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
