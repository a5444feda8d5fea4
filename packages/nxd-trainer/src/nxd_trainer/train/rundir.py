"""The run folder ``<runs_dir>/<name>/``: what is in it, who may change it, and when.

::

    config.toml        the settings of the run (of the last command that started or continued it)
    tokenizer/ data/   the tokenizer; data/meta.json names the run's token shards (in the cache)
    checkpoints/step_NNNNNNNN/   complete tags carry nxd-ckpt's ``done`` marker
    metrics.jsonl tb/  per-step rows (strict JSON) and TensorBoard scalars
    summary.json       the last session's final figures
    hf/                the Hugging Face export of the newest checkpoint

One run at a time: the process that owns the run (the ``nxd-train`` launcher on one node,
else global rank 0) holds an exclusive lock on ``.lock`` for the whole run, so a second
``nxd-train`` on the same folder stops at once, naming it. A command that would resume is
checked against the run before anything in the folder changes (:meth:`RunDir.check_resume`);
``config.toml`` is rewritten only by a command that starts or continues the run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxd_trainer.train.config import ConfigError, TrainConfig

__all__ = [
    "FROZEN",
    "Resume",
    "RunDir",
    "dumps_strict",
    "finite_or_none",
    "replace_dir",
    "tag_name",
]

# What must not change when a run is resumed (the degrees, ZeRO-1, steps... may).
FROZEN = ("model", "data", "tokenizer", "vocab_size", "seq_len", "corpus_mb", "val_fraction",
          "seed", "batch_size", "lora_rank", "lora_alpha", "lora_targets",
          "text_field")  # fmt: skip
TAG_PREFIX = "step_"
# Set by the launcher for its workers: it holds the run's lock and wrote config.toml.
OWNER_ENV = "NXD_TRAIN_LAUNCHER_OWNS_RUN"
# Set by the launcher for its workers: the tag to resume ("" for none), already verified.
RESUME_ENV = "NXD_TRAIN_RESUME_TAG"


def tag_name(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


@dataclass(frozen=True)
class Resume:
    """The newest complete checkpoint of a run: its tag, step and what nxd-train saved."""

    tag: str
    step: int
    user_content: dict[str, Any]


class RunDir:
    """The folder of one run (see the module docstring): ``RunDir(root)`` to read one,
    :meth:`of` a config to run one."""

    def __init__(self, root: str | os.PathLike[str], cfg: TrainConfig | None = None) -> None:
        self.root = Path(root)
        self._cfg = cfg

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunDir:
        """The folder of the run ``cfg`` describes (``<runs_dir>/<name>``)."""
        return cls(cfg.run_dir, cfg)

    @property
    def cfg(self) -> TrainConfig:
        if self._cfg is None:
            raise ValueError(f"{self.root} was opened to read: no run settings to compare")
        return self._cfg

    # Paths ------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def config_file(self) -> Path:
        return self.root / "config.toml"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.root / "summary.json"

    @property
    def export_dir(self) -> Path:
        return self.root / "hf"

    @property
    def merged_checkpoint(self) -> Path:
        """LoRA runs: the merged model (base + adapters), written at the end for the export."""
        return self.root / "export_checkpoint"

    # One run at a time ------------------------------------------------------------------
    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run's exclusive lock (a second holder fails at once with ConfigError)."""
        from filelock import FileLock, Timeout

        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.root / ".lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise ConfigError(
                f"the run folder {self.root} is in use by another nxd-train (its lock "
                f"{self.root / '.lock'} is held); wait for it to end, or use another --name"
            ) from None
        try:
            yield
        finally:
            lock.release()

    # Checkpoints ------------------------------------------------------------------------
    def complete_tags(self) -> list[str]:
        """Names of the complete ``step_N`` tags, oldest first: real folders (a symlink is
        not a tag of this run) holding nxd-ckpt's ``done`` marker."""
        if not self.checkpoints.is_dir():
            return []
        tags = []
        for path in self.checkpoints.iterdir():
            name = path.name
            if not (name.startswith(TAG_PREFIX) and name[len(TAG_PREFIX) :].isdigit()):
                continue
            if path.is_symlink() or not path.is_dir() or not (path / "done").is_file():
                continue
            tags.append(name)
        return sorted(tags, key=lambda name: int(name[len(TAG_PREFIX) :]))

    def newest_tag(self) -> str | None:
        tags = self.complete_tags()
        return tags[-1] if tags else None

    def resume_point(self, *, verify: bool = True) -> Resume | None:
        """The newest intact checkpoint and its user content (one process, no collective,
        nothing changed); None for a run with none.

        ``verify``: every file of the candidate tags is checked (sizes, headers, CRCs of every
        byte: ``nxd_ckpt.newest_intact_tag``), newest first; a damaged one is skipped with a
        warning naming it and the problem, and the run resumes from the newest intact one.
        Every tag damaged is an error (never a silent fresh start). A tag nxd-train did not
        write is an error naming it."""
        tags = self.complete_tags()
        if not tags:
            return None
        import nxd_ckpt

        tag = tags[-1]
        if verify:
            found = nxd_ckpt.newest_intact_tag(self.checkpoints, tags)
            for bad in found.damaged:
                warn(f"checkpoint {bad.path} is damaged ({bad.problem}); skipping it")
            if found.tag is None:
                raise ConfigError(
                    f"every checkpoint of {self.root} is damaged (newest: "
                    f"{found.damaged[0].problem}); move {self.checkpoints} away to start again"
                )
            tag = found.tag
        return self.read_point(tag)

    def read_point(self, tag: str) -> Resume:
        """Tag ``tag``'s step and user content (refused if nxd-train did not write it)."""
        import nxd_ckpt

        user = nxd_ckpt.read_user_content(self.checkpoints, tag)
        if not isinstance(user, dict) or not isinstance(user.get("config"), dict):
            raise ConfigError(
                f"{self.checkpoints / tag} was not saved by nxd-train (its user content has no "
                "run config); use another --name, or move that folder away"
            )
        return Resume(tag, int(user["step"]), user)

    def check_resume(self, resume: Resume) -> None:
        """Refuse to resume ``resume`` with settings that change what the run is (``FROZEN``):
        one line naming each changed setting, old -> new."""
        saved = resume.user_content["config"]
        changed = [k for k in FROZEN if saved.get(k) != getattr(self.cfg, k)]
        if changed:
            details = ", ".join(
                f"{k}: {saved.get(k)!r} -> {getattr(self.cfg, k)!r}" for k in changed
            )
            raise ConfigError(
                f"the run folder {self.root} holds a checkpoint of another setup ({details}); "
                "use another --name, or the saved settings"
            )

    def begin(self, resume: Resume | None) -> None:
        """Before a command changes the folder: ``resume`` (the resume point) checked against
        the command; then ``config.toml`` is written if the command starts or continues the
        run (a rerun of a finished run changes nothing)."""
        if resume is not None:
            self.check_resume(resume)
        if resume is None or resume.step < self.cfg.steps:
            self.write_config()

    # Files ------------------------------------------------------------------------------
    def write_config(self) -> None:
        _write_atomic(self.config_file, self.cfg.to_toml())

    def write_summary(self, summary: dict[str, Any]) -> None:
        _write_atomic(self.summary_file, dumps_strict(summary, indent=1))

    def read_summary(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.summary_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def metrics_rows(self, kind: str) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl`` of one kind (``train`` or ``eval``), in order."""
        if not self.metrics_file.is_file():
            return []
        rows = []
        for line in self.metrics_file.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if isinstance(row, dict) and row.get("kind") == kind:
                rows.append(row)
        return rows


def warn(message: str) -> None:
    """One line on stderr, ``nxd-train: warning: ...``."""
    import sys

    print(f"nxd-train: warning: {message}", file=sys.stderr, flush=True)


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN or infinity: such a value is written as null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def dumps_strict(row: dict[str, Any], **kwargs: Any) -> str:
    """``json.dumps`` of a row whose floats may be NaN or infinite (written as null)."""
    clean = {k: finite_or_none(v) if isinstance(v, float) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False, **kwargs)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_dir(tmp: Path, target: Path) -> None:
    """``target`` <- the folder ``tmp``, by renames: the old folder is moved aside first and
    removed after, so ``target`` is always either the old or the new folder, whole."""
    if target.exists():
        old = target.with_name(f".{target.name}.{os.getpid()}.old")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
