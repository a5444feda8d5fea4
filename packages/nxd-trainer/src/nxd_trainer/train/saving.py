"""How ``nxd-train`` saves its checkpoints: synchronously, or written in the background with
at most one save in flight; how long each save blocked the loop; a failed background write
named by its tag.

With ``async_save`` (the default) a save is nxd-ckpt's ``save_checkpoint(async_save=True,
async_copy="before_step")``. The call plans the save, copies the buffers, RNG states and the
user content to host memory and returns; a background thread copies the parameters and the
optimizer state into the same host buffer, then writes and commits the tag. The next
optimizer step waits until that copy is done (nxd-ckpt's step gate, a global
``torch.optim`` step pre-hook), so the forward and backward of the next step overlap the copy
and the tag holds the state of the step it names: the main job changes parameters and
optimizer state only inside optimizer steps (a change outside one is caught by the tensors'
version counters and fails the save, naming them). The loop is blocked for the call plus
what the next step waited: one :class:`SaveReport` per save, one line in the log.

On XLA the copy is made before the call returns (``async_copy="before_return"``): the deferred
copy is proven on CPU tensors only. On CUDA nxd-ckpt defers only the tensors that live on the
CPU; device tensors are copied to pinned host memory before the call returns.

Whatever needs a checkpoint waits for the one in flight (:meth:`Saver.wait`): the next save,
the end of the run and the Ctrl-C path (before the summary, the LoRA merge and the export),
and a resume (``load_checkpoint`` waits too). A background write that failed is raised there
as :class:`SaveFailed`, naming its tag. nxd-ckpt commits a tag only once every rank has
written it and removes old tags (``keep``) only after a commit, so the newest complete tag
before the failed one is intact.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SYNC", "SaveFailed", "SaveReport", "Saver", "save_mode"]

SYNC = "sync"
"""The save mode without ``async_save``: the tag is complete when the save returns."""


class SaveFailed(RuntimeError):
    """A checkpoint written in the background failed; the message names its tag."""


def save_mode(async_save: bool, device_type: str) -> str:
    """:data:`SYNC`, or the ``async_copy`` of nxd-train's async saves on ``device_type``."""
    if not async_save:
        return SYNC
    return "before_return" if device_type == "xla" else "before_step"


@dataclass
class SaveReport:
    """How long one save blocked the training loop on this rank: ``call_s``, the save call
    (which first waits for the previous save's write), plus ``wait_s``, what the loop then
    waited for it (the next optimizer step, for the host copy; at the end of the run, for
    the write)."""

    tag: str
    mode: str
    call_s: float
    wait_s: float = 0.0

    @property
    def blocked_s(self) -> float:
        return self.call_s + self.wait_s

    def line(self) -> str:
        if self.mode == SYNC:
            return f"checkpoint {self.tag}: saved, the loop was blocked {self.call_s:.3f} s"
        return (
            f"checkpoint {self.tag}: the loop was blocked {self.blocked_s:.3f} s (save call "
            f"{self.call_s:.3f} s, then waited {self.wait_s:.3f} s; async_copy={self.mode})"
        )


class Saver:
    """One rank's checkpoint saves (collective: every rank makes the same calls)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._in_flight: Path | None = None
        """The tag folder being written in the background."""
        self._unmeasured: SaveReport | None = None
        """The last async save, whose wait is not known yet."""
        self._reports: list[SaveReport] = []

    def describe(self) -> str:
        """One line: how this run saves."""
        if self.mode == SYNC:
            return "checkpoints: written before training continues (--no-async-save)"
        if self.mode == "before_return":
            return (
                "checkpoints: written in the background, copied to host memory before each "
                "save returns (async_copy=before_return: on XLA the copy is not deferred)"
            )
        return (
            "checkpoints: written in the background; the step after a save waits for its "
            "copy to host memory (async_copy=before_step; --no-async-save to write them "
            "synchronously)"
        )

    def save(self, folder: Path, tag: str, **objects: Any) -> None:
        """Save tag ``tag`` of ``folder`` (``objects``: ``nxd_trainer.save_checkpoint``'s
        arguments), once the save in flight is written."""
        import nxd_trainer as nxd

        started = time.perf_counter()
        self.wait()
        background = self.mode != SYNC
        nxd.save_checkpoint(
            folder, tag, **objects, async_save=background,
            async_copy=self.mode if background else "before_return",
        )  # fmt: skip
        report = SaveReport(tag, self.mode, time.perf_counter() - started)
        if background:
            self._in_flight, self._unmeasured = folder / tag, report
        else:
            self._reports.append(report)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around ``optimizer.step()``: what it waited for the last save's host copy is that
        save's wait."""
        report, self._unmeasured = self._unmeasured, None
        if report is None:
            yield
            return
        import nxd_ckpt

        waited = nxd_ckpt.async_copy_waited_s()
        yield
        report.wait_s = nxd_ckpt.async_copy_waited_s() - waited
        self._reports.append(report)

    def wait(self, *, release_host_memory: bool = False) -> None:
        """Until the save in flight is written and committed (collective); its failure is
        raised as :class:`SaveFailed`. ``release_host_memory``: free the host buffer the
        saves copy into (kept between saves, so each copy does not page-fault)."""
        if self.mode == SYNC:
            return
        import nxd_ckpt

        started = time.perf_counter()
        tag_dir, self._in_flight = self._in_flight, None
        try:
            nxd_ckpt.finalize_checkpoint(release_host_memory=release_host_memory)
        except Exception as error:
            if tag_dir is None:
                raise
            raise SaveFailed(
                f"checkpoint {tag_dir} was not saved: its background write failed "
                f"({type(error).__name__}: {error}); the checkpoints saved before it are kept"
            ) from error
        report, self._unmeasured = self._unmeasured, None
        if report is not None:
            report.wait_s = time.perf_counter() - started
            self._reports.append(report)

    def reports(self) -> list[SaveReport]:
        """The saves whose blocking time is known since the last call, oldest first."""
        done, self._reports = self._reports, []
        return done
