"""One worker of ``nxd-train``: build the parallel model, train, evaluate, checkpoint, resume.

Per optimizer step, with B global sequences, D data-parallel ranks and k accumulation steps:
each rank runs k micro-steps of B/(D·k) sequences (``run_train``: forward + backward, or the
pipeline schedule), its gradients are scaled by 1/k (so the step's gradient is the mean over
the global batch, as in one process), and the optimizer wrapper averages over DP, clips the
global norm and steps. The logged loss is the mean over the global batch: one all-reduce of
``[Σ loss, count, stop]`` over the world per step, which also carries the Ctrl-C flag so every
rank stops after the same step.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from nxd_trainer.train.config import ConfigError, TrainConfig

__all__ = ["CHECKPOINT_DIR", "PeerFailed", "newest_tag", "run_worker", "tag_name"]

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
EXIT_INTERRUPTED = 130
# What must not change when a run is resumed (the degrees, ZeRO-1, steps... may).
FROZEN = ("model", "data", "tokenizer", "vocab_size", "seq_len", "corpus_mb", "val_fraction",
          "seed", "batch_size", "lora_rank", "lora_alpha", "lora_targets",
          "text_field")  # fmt: skip


def tag_name(step: int) -> str:
    return f"step_{step:08d}"


def newest_tag(ckpt_dir: Path) -> str | None:
    """The complete tag (``done`` marker present) of the highest step, or None."""
    if not ckpt_dir.is_dir():
        return None
    tags = [
        p.name
        for p in ckpt_dir.iterdir()
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / "done").is_file()
    ]
    return max(tags, key=lambda name: int(name[5:])) if tags else None


def lr_lambda(cfg: TrainConfig) -> Any:
    """lr(s)/lr: linear warm-up (s+1)/W over W steps, then cosine from 1 to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class _Stop:
    """Ctrl-C / SIGTERM: finish the step, save, exit 130 (a second signal is ignored)."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def _agree(ok: bool, message: str) -> None:
    """Raise on every rank when any rank failed (one all-reduce of a flag)."""
    from nxd_state import collectives

    flag = torch.tensor([0.0 if ok else 1.0])
    collectives.all_reduce(flag)
    if flag.item() and ok:
        raise PeerFailed(message)


class PeerFailed(RuntimeError):
    """Another rank failed and said why; this one stops quietly."""


def _prepare(cfg: TrainConfig) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The data, made by local rank 0 of each node (unless the launcher already did)."""
    from nxd_trainer.train.data import prepare_data, prepare_lock

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    error: BaseException | None = None
    if local_rank == 0:
        try:
            with prepare_lock(cfg):
                prepare_data(cfg, build=True)
        except BaseException as e:  # raised below, after the others know
            error = e
    _agree(error is None, "data preparation failed on another rank")
    if error is not None:
        raise error
    return prepare_data(cfg, build=False)


def _eval_loss(cfg: TrainConfig, model: Any, valid: torch.Tensor, dp_rank: int, dp: int,
               contributes: bool) -> float:  # fmt: skip
    from nxd_state import collectives

    share = cfg.batch_size // (dp * cfg.grad_accum)
    total = torch.zeros(2, dtype=torch.float64)
    for b in range(cfg.eval_batches):
        start = b * cfg.batch_size + dp_rank * (cfg.batch_size // dp)
        for m in range(cfg.grad_accum):
            rows = [(start + m * share + i) % len(valid) for i in range(share)]
            ids = valid[rows].long()
            out = model.run_eval(input_ids=ids, labels=ids)
            loss = getattr(out, "loss", out)
            if loss is not None and contributes:
                total += torch.tensor([float(loss), 1.0], dtype=torch.float64)
    collectives.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def run_worker(cfg: TrainConfig) -> int:
    """Train as one rank of the job (the process group from torchrun's environment)."""
    import torch.distributed as dist

    import nxd_ckpt
    import nxd_state
    import nxd_trainer as nxd
    from nxd_state import collectives
    from nxd_trainer.train.data import PackedLoader
    from nxd_trainer.train.metrics import Metrics
    from nxd_trainer.train.model import build_nxd_config, hf_config, make_model_fn

    nxd_state.init_distributed(device_type=cfg.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = cfg.check_world(world)  # same answer on every rank: no collective needed
    torch.manual_seed(cfg.seed)
    tokenizer, train_blocks, valid_blocks = _prepare(cfg)
    config = hf_config(cfg, len(tokenizer))
    nxd_config = build_nxd_config(cfg, config)
    state = nxd_state.get_parallel_state()
    model = nxd.initialize_parallel_model(nxd_config, make_model_fn(cfg, config))
    if cfg.compile:
        _compile(model, cfg)
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
        eps=1e-8, weight_decay=cfg.weight_decay,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # One loader batch per micro-step: the k micro-steps of a step cover its B sequences.
    micro = cfg.batch_size // cfg.grad_accum
    loader = PackedLoader(train_blocks, micro, state.data_parallel_rank, dp, cfg.seed)
    run = cfg.run_dir
    ckpt_dir = run / CHECKPOINT_DIR
    step, tokens = 0, 0
    resume = newest_tag(ckpt_dir)
    if resume is not None:
        # The user content alone first (collective-free, touches nothing): a checkpoint of
        # another setup fails with the reason before any weight is read.
        _check_resumable(cfg, ckpt_dir / resume, nxd_ckpt.read_user_content(ckpt_dir, resume))
        user = nxd.load_checkpoint(
            ckpt_dir, resume, model=model, optimizer=optimizer, scheduler=scheduler
        )
        loader.load_state_dict(user["loader"])
        step, tokens = int(user["step"]), int(user["tokens"])
        # The schedule's horizon is this run's --steps (a rerun may extend the run).
        scheduler.lr_lambdas = [lr_lambda(cfg)]
    last_stage = state.pipeline_parallel_rank == state.pipeline_parallel_size - 1
    contributes = last_stage and state.tensor_parallel_rank == 0
    writer = rank == 0
    metrics = Metrics(run, writer=writer, steps=cfg.steps, start=step, bar=cfg.progress)
    if step and writer:
        metrics.write(f"resumed from {ckpt_dir / tag_name(step)} (step {step})")
        if step >= cfg.steps:
            metrics.write(
                f"the run is already at step {step} (--steps {cfg.steps}): nothing to train"
            )
    stop = _Stop()
    # A finished run rerun trains nothing, and evaluates and saves nothing new.
    saved_step, evaluated_step, interrupted = step, (step if step >= cfg.steps else -1), False
    tokens_per_step = cfg.batch_size * cfg.seq_len
    session_tokens, session_time = 0, 0.0

    def save() -> None:
        nonlocal saved_step
        user = {"step": step, "tokens": tokens, "loader": loader.state_dict(),
                "config": cfg.to_dict()}  # fmt: skip
        nxd.save_checkpoint(
            ckpt_dir, tag_name(step), model=model, optimizer=optimizer, scheduler=scheduler,
            user_content=user, num_kept_ckpts=cfg.keep, nxd_config=nxd_config,
        )  # fmt: skip
        saved_step = step

    model.train()
    final_loss = float("nan")
    try:
        while step < cfg.steps:
            started = time.perf_counter()
            local = torch.zeros(3, dtype=torch.float64)
            for _ in range(cfg.grad_accum):
                ids = loader.next_batch()
                loss = model.run_train(input_ids=ids, labels=ids)
                if loss is not None and contributes:
                    local[0] += float(loss)
                    local[1] += 1
            if cfg.grad_accum > 1:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(cfg.grad_accum)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += tokens_per_step
            local[2] = 1.0 if stop.requested else 0.0
            collectives.all_reduce(local)
            elapsed = time.perf_counter() - started
            session_tokens += tokens_per_step
            session_time += elapsed
            final_loss = (local[0] / local[1]).item()
            norm = optimizer.grad_norm
            metrics.train(
                step, final_loss, scheduler.get_last_lr()[0],
                float(norm) if norm is not None else float("nan"), tokens,
                tokens_per_step / elapsed,
            )  # fmt: skip
            if cfg.eval_every and step % cfg.eval_every == 0:
                metrics.eval(step, _eval_loss(cfg, model, valid_blocks, state.data_parallel_rank,
                                              dp, contributes))  # fmt: skip
                evaluated_step = step
            if local[2] > 0:
                interrupted = True
                break
            if step % cfg.save_every == 0:
                save()
        if not interrupted and evaluated_step != step:
            val = _eval_loss(cfg, model, valid_blocks, state.data_parallel_rank, dp, contributes)
            metrics.eval(step, val)
        if saved_step != step or newest_tag(ckpt_dir) is None:
            save()
    finally:
        stop.restore()
        metrics.close()
    if cfg.export and not interrupted and cfg.lora_rank:
        _save_merged(cfg, model)
    collectives.barrier()
    if writer:
        summary = {
            "step": step,
            "tokens": tokens,
            "tokens_per_s": session_tokens / session_time if session_time else 0.0,
            # No step this session (a rerun of a finished run): the last logged loss.
            "loss": final_loss if final_loss == final_loss else _last_logged_loss(run),
            "checkpoint": str(ckpt_dir / tag_name(step)),
        }
        _write_summary(run, summary, interrupted)
    if interrupted:
        if writer:
            metrics.write(
                f"interrupted: saved {ckpt_dir / tag_name(step)}; rerun the same command to resume"
            )
        return EXIT_INTERRUPTED
    import torch.distributed as dist

    dist.destroy_process_group()
    if writer:
        _finish(cfg, summary)
    return 0


def _finish(cfg: TrainConfig, summary: dict[str, Any]) -> None:
    """Export, sample and the one-line summary (rank 0, after the job's collectives)."""
    import json
    import sys

    from nxd_trainer.train.export import export_run, generate_sample

    run = cfg.run_dir
    where = f"run folder {run}: checkpoints/, tb/, metrics.jsonl"
    if cfg.export:
        out = export_run(run)
        where += f", hf/ (exported {out})"
        if cfg.sample_tokens:
            text = generate_sample(out, cfg.prompt, cfg.sample_tokens, cfg.seed)
            print(f"--- sample from {out} ---\n{text}\n---", flush=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    val = evals[-1] if evals else None
    loss = "n/a" if summary["loss"] is None else f"{summary['loss']:.4f}"
    print(
        f"nxd-train: {summary['step']} steps, {summary['tokens']:,} tokens, "
        f"{summary['tokens_per_s']:,.0f} tokens/s; loss {loss}"
        + (
            f", validation loss {val['val_loss']:.4f} (perplexity {val['val_perplexity']:.2f})"
            if val
            else ""
        )
        + f"; {where}",
        file=sys.stderr,
        flush=True,
    )


def _save_merged(cfg: TrainConfig, model: Any) -> None:
    """LoRA: the merged base (no adapter) as a tag of its own, for the HF export."""
    import nxd_ckpt

    lora_model = model.local_module()
    lora_config = lora_model.lora_config
    saved = (lora_config.save_lora_base, lora_config.merge_lora)
    lora_config.save_lora_base, lora_config.merge_lora = True, True
    try:
        nxd_ckpt.save_checkpoint(cfg.run_dir / "export_checkpoint", "", model=lora_model)
    finally:
        lora_config.save_lora_base, lora_config.merge_lora = saved


def _last_logged_loss(run: Path) -> float | None:
    """The loss of the last train row of ``metrics.jsonl`` (None when there is none)."""
    import json

    path = run / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    trained = [r for r in rows if r.get("kind") == "train"]
    return trained[-1]["loss"] if trained else None


def _write_summary(run: Path, summary: dict[str, Any], interrupted: bool) -> None:
    import json

    tmp = run / f".summary.{os.getpid()}"
    tmp.write_text(json.dumps(summary | {"interrupted": interrupted}, indent=1))
    os.replace(tmp, run / "summary.json")


def _check_resumable(cfg: TrainConfig, tag_dir: Path, user: Any) -> None:
    if not isinstance(user, dict) or not isinstance(user.get("config"), dict):
        raise ConfigError(
            f"{tag_dir} was not saved by nxd-train (its user content has no run config); "
            "use another --name, or move that folder away"
        )
    saved = user["config"]
    changed = [k for k in FROZEN if saved.get(k) != getattr(cfg, k)]
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}" for k in changed)
        raise ConfigError(
            f"the run folder {cfg.run_dir} holds a checkpoint of another setup ({details}); "
            "use another --name, or the saved settings"
        )


def _compile(model: Any, cfg: TrainConfig) -> None:
    import nxd_state

    if nxd_state.resolve_device_type(cfg.device) != "cuda":
        raise ConfigError("--compile is for CUDA devices (torch.compile on CPU is not offered)")
    if cfg.pp > 1:
        raise ConfigError("--compile needs pp=1 (the pipeline runs captured stage graphs)")
    for module in model.local_module().modules():
        if type(module).__name__.endswith("DecoderLayer"):
            module.compile()
