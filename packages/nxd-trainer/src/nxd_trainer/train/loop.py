"""What each ``nxd-train`` worker runs: prepare, build the :class:`Trainer`, resume, train with
evaluation and checkpoints, and finish (summary, export, sample).

Ctrl-C (SIGINT, or the SIGTERM of a scheduler) sets a flag that the step's all-reduce carries,
so every rank finishes the same step, saves it, and exits 130; the launcher prints the one
line that says so. A second signal is ignored while that save runs.

Checkpoints are written in the background by default (:mod:`nxd_trainer.train.saving`): the
loop waits for the one in flight before its last save, and for the last one before it
returns, on the Ctrl-C path too; the summary, the LoRA merge and the export come after. Each
save's blocking time is one line of the log (rank 0).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch

from nxd_trainer.train import _signals
from nxd_trainer.train.config import TrainConfig
from nxd_trainer.train.rundir import (
    OWNER_ENV,
    RESUME_ENV,
    Resume,
    RunDir,
    finite_or_none,
    tag_name,
)
from nxd_trainer.train.saving import Saver

__all__ = ["EXIT_INTERRUPTED", "PeerFailed", "run_worker", "summary_line"]

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130


class _Stop:
    """Ctrl-C / SIGTERM: finish the step, save, exit 130 (a second signal is ignored)."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        _signals.mark()
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


class PeerFailed(RuntimeError):
    """Another rank failed and said why; this one stops quietly."""


def _agree(ok: bool, message: str) -> None:
    """Raise on every rank when any rank failed (one all-reduce of a flag)."""
    import nxd_state
    from nxd_state import collectives

    flag = torch.tensor([0.0 if ok else 1.0], device=nxd_state.current_device())
    collectives.all_reduce(flag)
    if flag.item() and ok:
        raise PeerFailed(message)


def _owns_run(rank: int) -> bool:
    """Whether this worker owns the run folder (locks it, writes config.toml): global rank 0,
    unless the nxd-train launcher of a single node already does."""
    return rank == 0 and os.environ.get(OWNER_ENV) != "1"


def _resume_point(run: RunDir) -> Resume | None:
    """The checkpoint to resume, the same on every rank: the one the launcher verified, or
    (under torchrun) the one rank 0 verified, its step broadcast; the others read only its
    user content."""
    import torch.distributed as dist

    import nxd_state
    from nxd_state import collectives

    chosen = os.environ.get(RESUME_ENV)
    if chosen is not None:
        return run.read_point(chosen) if chosen else None
    step = torch.tensor([-1], dtype=torch.int64, device=nxd_state.current_device())
    point: Resume | None = None
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            point = run.resume_point(verify=True)
        except BaseException as e:  # raised below, after the others know
            error = e
        step[0] = point.step if point is not None else -1
    _agree(error is None, "the run's checkpoints were refused on another rank")
    if error is not None:
        raise error
    collectives.broadcast(step, src=0)
    if dist.get_rank() != 0 and int(step.item()) >= 0:
        point = run.read_point(tag_name(int(step.item())))
    return point


def _prepare(cfg: TrainConfig, run: RunDir, owner: bool) -> tuple[Resume | None, Any]:
    """The resume point, checked against the run before anything in it changes; then the
    data, made by local rank 0 of each node (unless the launcher already did) and read on
    every rank."""
    from nxd_trainer.train.data import prepare_data, prepare_lock

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    point = _resume_point(run)
    error: BaseException | None = None
    try:
        if owner:
            run.begin(point)
        elif point is not None:
            run.check_resume(point)
    except BaseException as e:  # raised below, after the others know
        error = e
    _agree(error is None, "the run folder was refused on another rank")
    if error is not None:
        raise error
    if local_rank == 0:
        try:
            with prepare_lock(cfg):
                prepare_data(cfg, build=True)
        except BaseException as e:
            error = e
    _agree(error is None, "data preparation failed on another rank")
    if error is not None:
        raise error
    return point, prepare_data(cfg, build=False)


def run_worker(cfg: TrainConfig) -> int:
    """Train as one rank of the job (the process group from torchrun's environment)."""
    import contextlib

    import torch.distributed as dist

    import nxd_state

    nxd_state.init_distributed(device_type=cfg.device)
    run = RunDir.of(cfg)
    owner = _owns_run(dist.get_rank())
    lock = run.lock() if owner else contextlib.nullcontext()
    error: BaseException | None = None
    try:
        lock.__enter__()
    except BaseException as e:
        error = e
    _agree(error is None, "the run folder is in use")
    if error is not None:
        raise error
    try:
        return _train(cfg, run)
    finally:
        lock.__exit__(None, None, None)


def _train(cfg: TrainConfig, run: RunDir) -> int:
    import torch.distributed as dist

    from nxd_state import collectives
    from nxd_trainer.train.trainer import Trainer

    rank = dist.get_rank()
    point, data = _prepare(cfg, run, _owns_run(rank))
    trainer = Trainer(cfg, run, data)
    if point is not None:
        trainer.resume(point)
    writer = rank == 0
    session = _run_steps(cfg, run, trainer, writer)
    if cfg.export and not session.interrupted and cfg.lora_rank:
        trainer.save_merged()
    collectives.barrier()
    if writer:
        summary = _summary(run, trainer, session)
        run.write_summary(summary)
    if session.interrupted:
        return EXIT_INTERRUPTED
    dist.destroy_process_group()
    if writer:
        _finish(cfg, run, summary)
    return 0


@dataclass
class _Session:
    """What this process's session trained: tokens, seconds, the last loss, and whether a
    signal stopped it."""

    tokens: int = 0
    seconds: float = 0.0
    last_loss: float = float("nan")
    interrupted: bool = False


def _run_steps(cfg: TrainConfig, run: RunDir, trainer: Any, writer: bool) -> _Session:
    """Train up to ``cfg.steps``, evaluating every ``eval_every`` steps and saving every
    ``save_every``; then the final evaluation and save, unless already done (a signal: the
    step it stopped at is saved, not evaluated)."""
    from nxd_trainer.train.metrics import Metrics

    metrics = Metrics(run.root, writer=writer, steps=cfg.steps, start=trainer.step,
                      bar=cfg.progress)  # fmt: skip
    if trainer.step:
        metrics.write(
            f"resumed from {run.checkpoints / tag_name(trainer.step)} (step {trainer.step})"
        )
    if trainer.step >= cfg.steps:
        metrics.write(f"the run is finished: it is at step {trainer.step} (--steps {cfg.steps})")
    else:
        metrics.write(trainer.saver.describe())
    stop = _Stop()
    session = _Session()
    saved_step = trainer.step
    # A finished run rerun trains nothing, and evaluates and saves nothing new.
    evaluated_step = trainer.step if trainer.step >= cfg.steps else -1
    try:
        while trainer.step < cfg.steps:
            result = trainer.train_step(stop.requested)
            session.tokens += cfg.batch_size * cfg.seq_len
            session.seconds += result.seconds
            session.last_loss = result.loss
            metrics.train(
                result.step, result.loss, result.lr, result.grad_norm, trainer.tokens,
                cfg.batch_size * cfg.seq_len / result.seconds,
            )  # fmt: skip
            if cfg.eval_every and result.step % cfg.eval_every == 0:
                metrics.eval(result.step, trainer.evaluate())
                evaluated_step = result.step
            if result.stop:
                session.interrupted = True
                break
            if result.step % cfg.save_every == 0:
                trainer.save()
                saved_step = result.step
            _log_saves(metrics, trainer.saver)  # an async save's: once the next step waited
        if not session.interrupted and evaluated_step != trainer.step:
            metrics.eval(trainer.step, trainer.evaluate())
        trainer.saver.wait()  # the tag in flight complete (or its error raised) before the check
        if saved_step != trainer.step or run.newest_tag() is None:
            trainer.save()
        trainer.saver.wait(release_host_memory=True)  # the last tag complete before anything else
        _log_saves(metrics, trainer.saver)
    finally:
        stop.restore()
        metrics.close()
    return session


def _log_saves(metrics: Any, saver: Saver) -> None:
    """One line per save whose blocking time is known (the writer rank)."""
    for report in saver.reports():
        metrics.write(report.line())


def _summary(run: RunDir, trainer: Any, session: _Session) -> dict[str, Any]:
    """The run's final figures. A session that trained no step (a rerun of a finished run)
    reports the figures of the session that did: the last logged loss and its tokens/s."""
    previous = run.read_summary() or {}
    trained = [r for r in run.metrics_rows("train") if r.get("step", 0) <= trainer.step]
    loss = session.last_loss
    last: float | None = loss
    if loss != loss:  # NaN: no step this session
        last = trained[-1]["loss"] if trained else None
    if session.seconds:
        speed: float | None = session.tokens / session.seconds
    elif previous.get("step") == trainer.step:
        speed = previous.get("tokens_per_s")
    else:
        speed = None
    return {
        "step": trainer.step,
        "tokens": trainer.tokens,
        "tokens_per_s": speed,
        "loss": finite_or_none(last),
        "checkpoint": str(run.checkpoints / tag_name(trainer.step)),
        "interrupted": session.interrupted,
    }


def _finish(cfg: TrainConfig, run: RunDir, summary: dict[str, Any]) -> None:
    """Export, sample and the one-line summary (rank 0, after the job's collectives)."""
    import sys

    from nxd_trainer.train.export import export_run, generate_sample

    exported = None
    if cfg.export:
        exported = export_run(run.root)
        if cfg.sample_tokens:
            text = generate_sample(exported, cfg.prompt, cfg.sample_tokens, cfg.seed)
            print(f"--- sample from {exported} ---\n{text}\n---", flush=True)
    print(f"nxd-train: {summary_line(run, summary, exported)}", file=sys.stderr, flush=True)


def summary_line(run: RunDir, summary: dict[str, Any], exported: Any = None) -> str:
    """``N steps, T tokens, S tokens/s; loss L, validation loss V (perplexity P); run folder
    ...``: the run's final figures in one line."""
    figures = [f"{summary['step']} steps", f"{summary['tokens']:,} tokens"]
    if summary.get("tokens_per_s") is not None:
        figures.append(f"{summary['tokens_per_s']:,.0f} tokens/s")
    loss = summary.get("loss")
    text = ", ".join(figures) + f"; loss {'n/a' if loss is None else f'{loss:.4f}'}"
    evals = [r for r in run.metrics_rows("eval") if r.get("step", 0) <= summary["step"]]
    if evals and evals[-1].get("val_loss") is not None:
        val = evals[-1]
        text += f", validation loss {val['val_loss']:.4f} (perplexity {val['val_perplexity']:.2f})"
    where = f"run folder {run.root}: checkpoints/, tb/, metrics.jsonl"
    if exported is not None:
        where += f", hf/ (exported {exported})"
    return f"{text}; {where}"
