"""nxd-train's throughput side by side with the Hugging Face ``Trainer`` (the main job's bench).

    .venv/bin/python bench/train.py [--steps 60] [--rounds 3] [--model tiny] [--seq-len 128]

Same data, model and steps for every entry: the run's own packed blocks (prepared once by
nxd-train in a scratch run folder), the preset Llama built from the same seed, AdamW with the
same LR schedule, clipping at 1.0, fp32 on CPU.

* ``nxd-train`` at TP=1 (one process, its default thread count) vs ``transformers.Trainer``
  (one process, same threads) on the same blocks. nxd-train's step times come from its JSONL rows;
  the Trainer's from a callback (``on_step_begin`` -> ``on_step_end``). Rounds alternate which
  side runs first; the ratio is reported per round and as the median. Goal: >= 1.0x.
* ``nxd-train`` at TP=2 (2 processes, 1 thread each) vs TP=1 on 1 process with 2 threads:
  what tensor parallelism gives over intra-op threading on the same 2 cores (noted, no goal).

Results in bench/results/train.json. The machine may be shared: the load average is recorded.

    .venv/bin/python bench/train.py --saves [--model small] [--rounds 5]

``--saves``: how long nxd-train's own loop is blocked per checkpoint, async (the default,
``async_copy="before_step"``) vs a synchronous save of the same state, side by side in one
process (TP=1, one rank, a world of one). Each round, on the live training state of the
main job's :class:`~nxd_trainer.train.Trainer`: a step; a synchronous save (blocked: the
call); a step; an async save (blocked: the call plus what the next optimizer step waited for
the host copy, the Trainer's own ``SaveReport``), whose write is then waited for, untimed.
A step without a save nearby and the step after each async save are timed too (the
background write competes for the cores: a slowdown, not blocked time). Goal: blocked <= 0.1x
the synchronous save. Results in bench/results/train_saves.json, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from nxd_trainer.train import parse_config
from nxd_trainer.train.data import prepare_data

ROOT = Path(__file__).resolve().parent.parent


def nxd_train(args: list[str], cwd: Path, threads: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = str(threads)
    subprocess.run(
        [sys.executable, "-m", "nxd_trainer.train", *args], cwd=cwd, env=env, check=True,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


def nxd_step_times(run: Path, warmup: int) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train" and r["step"] > warmup]
    return [r["tokens"] / r["step"] / r["tokens_per_s"] for r in train]


def hf_trainer_step_times(run: Path, common: list[str], steps: int, warmup: int) -> list[float]:
    """The same model, data and optimizer under ``transformers.Trainer`` (in this process)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from nxd_trainer.train import parse_config
    from nxd_trainer.train.data import PackedLoader, prepare_data
    from nxd_trainer.train.model import hf_config
    from nxd_trainer.train.trainer import lr_lambda

    cfg = parse_config([*common, "--runs-dir", str(run.parent), "--name", run.name])
    tokenizer, train, _ = prepare_data(cfg, build=False)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, len(tokenizer)))
    loader = PackedLoader(train, cfg.batch_size, 0, 1, cfg.seed)
    ordered = torch.cat([loader.next_batch() for _ in range(steps)])  # nxd-train's order

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ordered)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ordered[i], "labels": ordered[i]}

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            times.append(time.perf_counter() - self.start)

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    arguments = TrainingArguments(
        output_dir=str(run / "hf-trainer"), per_device_train_batch_size=cfg.batch_size,
        max_steps=steps, max_grad_norm=cfg.clip, logging_strategy="no", save_strategy="no",
        report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=arguments, train_dataset=Blocks(), optimizers=(optimizer, scheduler),
        callbacks=[Timer()],
    )  # fmt: skip
    trainer.train_dataset = Blocks()
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(Blocks())
    trainer.train()
    return times[warmup:]


def _quartiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "q1": q[0], "q3": q[2]}


def save_blocking(args: argparse.Namespace) -> dict[str, object]:
    """The loop blocked per save, async vs sync, on one Trainer (see ``--saves``)."""
    import nxd_state
    from nxd_trainer.train import RunDir, Trainer
    from nxd_trainer.train.saving import SYNC, Saver

    # One thread, as each nxd-train rank of a shared machine: OpenMP regions stall while the
    # cores are busy (the background write takes one), which would time the machine instead.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        cfg = parse_config([
            "--model", args.model, "--seq-len", str(args.seq_len), "--batch-size",
            str(args.batch_size), "--steps", "1000", "--tp", "1", "--nproc-per-node", "1",
            "--corpus-mb", "2", "--keep", "1", "--runs-dir", scratch, "--name", "saves",
        ])  # fmt: skip
        data = prepare_data(cfg, build=True)
        nxd_state.init_distributed(device_type="cpu")  # a world of one
        trainer = Trainer(cfg, RunDir.of(cfg), data)
        sync, background = Saver(SYNC), Saver("before_step")
        reports: list[Any] = []  # each save's SaveReport: call and wait apart

        def timed_step() -> float:
            return trainer.train_step().seconds

        def save_with(saver: Saver) -> tuple[float, float]:
            """(blocked seconds, the next step's seconds) of one save by ``saver``."""
            trainer.saver = saver
            trainer.save()
            after = timed_step()  # the step after the save: its wait is the save's
            saver.wait()  # the write (untimed; the next save would wait for it)
            (report,) = saver.reports()
            reports.append(report)
            return report.blocked_s, after

        for _ in range(3):  # warm-up: allocator, page cache, the host buffer's first fill
            timed_step()
        save_with(background)
        state = [*trainer.model.parameters()]  # and AdamW's moments, made by the first step
        state += [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim()]
        rounds = []
        for _ in range(args.rounds):
            load = os.getloadavg()[0]
            quiet = timed_step()
            sync_s, _ = save_with(sync)
            blocked_s, after_s = save_with(background)
            one = {"load_avg_1min": load, "sync_save_s": sync_s, "async_blocked_s": blocked_s,
                   "async_call_s": reports[-1].call_s, "async_step_waited_s": reports[-1].wait_s,
                   "step_s": quiet, "step_after_async_save_s": after_s}  # fmt: skip
            rounds.append(one)
            print(json.dumps(one), flush=True)
        background.wait(release_host_memory=True)
    ratio = _quartiles([r["async_blocked_s"] / r["sync_save_s"] for r in rounds])
    return {
        "model": args.model,
        "state_bytes": sum(t.numel() * t.element_size() for t in state),
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "sync_save_s": _quartiles([r["sync_save_s"] for r in rounds]),
        "async_blocked_s": _quartiles([r["async_blocked_s"] for r in rounds]),
        "async_blocked_over_sync_save": ratio,
        "step_s": _quartiles([r["step_s"] for r in rounds]),
        "step_after_async_save_s": _quartiles([r["step_after_async_save_s"] for r in rounds]),
        "goal": "async_blocked_over_sync_save <= 0.1",
        "goal_met": ratio["median"] <= 0.1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="default: bench/results/train[_saves].json")
    parser.add_argument("--saves", action="store_true", help="the loop blocked per save")
    args = parser.parse_args()
    results_dir = ROOT / "bench" / "results"
    if args.saves:
        out = {"load_before": os.getloadavg(), **save_blocking(args)}
        out["load_after"] = os.getloadavg()
        path = Path(args.out or results_dir / "train_saves.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
        return
    args.out = args.out or str(results_dir / "train.json")
    common = [
        "--model", args.model, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
        "--steps", str(args.steps), "--eval-every", "0", "--save-every", str(10 * args.steps),
        "--no-export", "--no-progress", "--corpus-mb", "2",
    ]  # fmt: skip
    tokens_per_step = args.seq_len * args.batch_size
    results: dict[str, object] = {"settings": vars(args), "load_before": os.getloadavg()}
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        cwd = Path(scratch)

        def rate(times: list[float]) -> float:
            """tokens/s of the fastest decile of steps: on a shared machine load spikes only
            ever slow a step down, so the fast steps are the ones least disturbed."""
            return tokens_per_step / sorted(times)[len(times) // 10]

        def nxd(name: str, extra: list[str], threads: int) -> float:
            nxd_train([*common, "--name", name, *extra], cwd, threads)
            return rate(nxd_step_times(cwd / "runs" / name, args.warmup))

        for r in range(args.rounds):  # the order alternates, so load drifts hit both sides
            one: dict[str, float] = {}
            for side in ("nxd", "hf") if r % 2 == 0 else ("hf", "nxd"):
                if side == "nxd":  # TP=1 on one process, all cores (the Trainer's threads)
                    one["nxd_tp1"] = nxd(
                        f"tp1-{r}", ["--tp", "1", "--nproc-per-node", "1"], threads
                    )
                else:
                    # The Trainer reads the run's packed blocks: prepare them if it goes first.
                    prepare_data(
                        parse_config(
                            [*common, "--runs-dir", str(cwd / "runs"), "--name", f"tp1-{r}"]
                        ),
                        build=True,
                    )
                    times = hf_trainer_step_times(
                        cwd / "runs" / f"tp1-{r}", common, args.steps, args.warmup
                    )
                    one["hf_trainer"] = rate(times)
            # TP=2 (2 processes x 1 thread) vs TP=1 (1 process x 2 threads).
            one["nxd_tp2"] = nxd(f"tp2-{r}", ["--tp", "2", "--nproc-per-node", "2"], 1)
            one["nxd_tp1_2threads"] = nxd(f"tp1t-{r}", ["--tp", "1", "--nproc-per-node", "1"], 2)
            rounds.append(one)
            print(json.dumps(one), flush=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    results["rounds_tokens_per_s"] = rounds
    results["tp1_vs_hf_trainer"] = {
        "threads": threads, "nxd_train_tokens_per_s": med["nxd_tp1"],
        "hf_trainer_tokens_per_s": med["hf_trainer"],
        "ratio_per_round": [r["nxd_tp1"] / r["hf_trainer"] for r in rounds],
        "ratio_median": statistics.median(r["nxd_tp1"] / r["hf_trainer"] for r in rounds),
        "goal": ">= 1.0",
    }  # fmt: skip
    results["tp2_vs_one_process_2_threads"] = {
        "tp2_tokens_per_s": med["nxd_tp2"], "tp1_2_threads_tokens_per_s": med["nxd_tp1_2threads"],
        "ratio_median": statistics.median(r["nxd_tp2"] / r["nxd_tp1_2threads"] for r in rounds),
    }  # fmt: skip
    results["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
