"""What the user sees and keeps: a tqdm bar (one rank), TensorBoard scalars and a JSONL file.

Rows of ``metrics.jsonl`` (one JSON object a line)::

    {"kind": "train", "step": 10, "loss": 5.91, "lr": 0.001, "grad_norm": 1.3,
     "tokens": 20480, "tokens_per_s": 5120.0, "time": 1716200000.0}
    {"kind": "eval", "step": 100, "val_loss": 4.2, "val_perplexity": 66.7, "time": ...}

TensorBoard tags: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
``val/loss``, ``val/perplexity`` (``<run>/tb``). On resume, rows after the resumed step are
dropped from the JSONL file, so it always reads as one uninterrupted run. Every line is strict
JSON: a value that is not a finite number (a diverged loss) is written as ``null`` and left out
of TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from nxd_trainer.train.rundir import dumps_strict

__all__ = ["Metrics"]


class Metrics:
    """Progress bar, TensorBoard and JSONL of one run; a no-op on every rank but the writer."""

    def __init__(self, run_dir: Path, *, writer: bool, steps: int, start: int, bar: bool) -> None:
        self.writer = writer
        self.path = run_dir / "metrics.jsonl"
        self._bar: Any = None
        self._tb: Any = None
        self._file: Any = None
        if not writer:
            return
        self._truncate(start)
        self._file = self.path.open("a", encoding="utf-8")
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=start + 1 if start else None)
        if bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stderr, mininterval=0.5,
            )  # fmt: skip

    def _truncate(self, start: int) -> None:
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            if row.get("step", 0) <= start:
                kept.append(line)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def _row(self, row: dict[str, Any]) -> None:
        self._file.write(dumps_strict(row) + "\n")
        self._file.flush()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if math.isfinite(value):
            self._tb.add_scalar(tag, value, step)

    def train(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int,
              tokens_per_s: float) -> None:  # fmt: skip
        if not self.writer:
            return
        self._row({"kind": "train", "step": step, "loss": loss, "lr": lr,
                   "grad_norm": grad_norm, "tokens": tokens, "tokens_per_s": tokens_per_s,
                   "time": time.time()})  # fmt: skip
        for tag, value in (("loss", loss), ("lr", lr), ("grad_norm", grad_norm),
                           ("tokens_per_s", tokens_per_s)):  # fmt: skip
            self._scalar(f"train/{tag}", value, step)
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}",
                gnorm=f"{grad_norm:.2f}", refresh=False,
            )  # fmt: skip
            self._bar.update(1)

    def eval(self, step: int, loss: float) -> float:
        perplexity = math.exp(min(loss, 50.0))
        if self.writer:
            self._row({"kind": "eval", "step": step, "val_loss": loss,
                       "val_perplexity": perplexity, "time": time.time()})  # fmt: skip
            self._scalar("val/loss", loss, step)
            self._scalar("val/perplexity", perplexity, step)
            self.write(f"step {step}: validation loss {loss:.4f}, perplexity {perplexity:.2f}")
        return perplexity

    def write(self, message: str) -> None:
        """A line above the bar (or plainly), on the writer rank only."""
        if not self.writer:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
