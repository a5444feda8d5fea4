"""Running one save: synchronously or in a background thread, with its errors agreed.

A :class:`SaveJob` holds one save's plan and runs its two phases, whose steps
:mod:`nxd_ckpt.save._save` defines. *Write* (every rank): this rank's data file and
manifest. *Commit* (rank 0 only): merge the manifests into ``index.json`` (atomic replace:
the commit point), write ``done``, remove older data. Once ``done`` is written the save has
succeeded: a problem while cleaning up or removing old tags is a
:class:`~nxd_ckpt.format._tags.RetentionWarning` (and a log line), never the save's error.

Synchronously, ranks agree on the write outcome before rank 0 commits, and on the commit
outcome before returning. Asynchronously the write (and rank 0's commit) run in a thread
over a host copy of the data taken at save time; :func:`wait_pending` (the next save,
``finalize_checkpoint`` or ``load_checkpoint``) joins it and raises any error it hit on
every rank. An interpreter exit waits for the thread too (without collectives).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nxd_ckpt.format import DONE_MARKER
from nxd_ckpt.format._contain import real_dir
from nxd_ckpt.format._stfile import FilePlan
from nxd_ckpt.layout._context import RankContext, agree
from nxd_ckpt.save import _step_gate
from nxd_ckpt.save._plan import RankPlan
from nxd_ckpt.save._write import DeferredCopy

__all__ = ["SaveJob", "pending_job", "wait_pending"]

logger = logging.getLogger(__name__)


@dataclass
class SaveJob:
    """One save: where it goes, this rank's plan, and the state of its two phases."""

    root: Path
    tag: str
    tag_dir: Path
    data_dir: Path
    save_id: str
    plan: RankPlan
    num_kept: int | None
    num_workers: int
    write_step: Callable[[SaveJob], None]
    """Every rank: write this rank's file and manifest (``_save.write_files``)."""
    commit_step: Callable[[SaveJob], None]
    """Rank 0, after every rank wrote: merge, commit, mark done, clean up (``_save.commit``)."""
    file_plan: FilePlan | None = None
    staged: list[torch.Tensor] | None = None
    deferred: list[DeferredCopy] | None = None
    """Chunks still to copy into ``staged`` before writing (the next optimizer step waits)."""
    commit_timeout_s: float = 3600.0
    written: threading.Event = field(default_factory=threading.Event)
    cancel: threading.Event = field(default_factory=threading.Event)
    write_error: BaseException | None = None
    commit_error: BaseException | None = None
    thread: threading.Thread | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def ctx(self) -> RankContext:
        return self.plan.ctx

    # Phases (the steps are nxd_ckpt.save._save's; here their errors are kept) -------------
    def write(self) -> None:
        """Every rank: :attr:`write_step`; an error is kept as :attr:`write_error` and marked
        in the data folder for rank 0."""
        try:
            self.write_step(self)
        except BaseException as error:
            self.write_error = error
            self._mark_failed(error)
        finally:
            self.staged = None  # the host copy is no longer needed
            self.written.set()

    def _mark_failed(self, error: BaseException) -> None:
        """Tell rank 0 to stop waiting for this rank (best effort: the disk may be full)."""
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)  # the copy may fail before it
            path = self.data_dir / f"failed_rank_{self.ctx.rank:05d}"
            path.write_text("".join(traceback.format_exception_only(type(error), error)))
        except OSError:
            pass

    def commit(self) -> None:
        """Rank 0: :attr:`commit_step`; an error is kept as :attr:`commit_error`."""
        try:
            self.commit_step(self)
        except BaseException as error:
            self.commit_error = error

    # Running -----------------------------------------------------------------------------
    def discard(self) -> None:
        """Rank 0, once every rank has stopped writing a save that failed: remove its data
        folder (partial files, failure notes), best effort, unless the tag is marked done (a
        commit whose cleanup failed: then the folder is the tag's data). The tag folder stays,
        without ``done``: an incomplete tag, as after a kill."""
        if self.ctx.rank != 0 or (self.tag_dir / DONE_MARKER).exists():
            return
        try:
            real_dir(self.data_dir, "checkpoint data folder")
        except (OSError, ValueError):
            return  # missing, or a link: nothing of this save to remove
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def run_sync(self) -> None:
        """Write, agree, commit (rank 0), agree: every rank returns once the tag is done."""
        self.write()
        try:
            agree(self.write_error, f"saving checkpoint {self.tag_dir}")
            if self.ctx.rank == 0:
                self.commit()
            agree(self.commit_error, f"committing checkpoint {self.tag_dir}")
        except BaseException:
            self.discard()  # every rank has returned from write(): none is writing
            raise

    def start_async(self) -> None:
        if self.deferred:
            _step_gate.close()

        def body() -> None:
            self.write()
            if self.ctx.rank == 0 and self.write_error is None:
                self.commit()

        self.thread = threading.Thread(target=body, name=f"nxd-ckpt-save-{self.tag}")
        try:
            self.thread.start()
        except BaseException:
            _step_gate.open_gate()  # no thread will copy: steps must not wait forever
            raise

    def finish(self, collective: bool) -> None:
        """Join the background save; raise its error (on every rank when ``collective``)."""
        self.written.wait()
        if collective:
            try:
                agree(self.write_error, f"saving checkpoint {self.tag_dir} (async)")
            except BaseException:
                self.cancel.set()
                if self.thread is not None:
                    self.thread.join()
                self.discard()  # every rank's writer has finished, rank 0's commit stopped
                raise
        elif self.write_error is not None:
            self.cancel.set()
        if self.thread is not None:
            self.thread.join()
        if collective:
            try:
                agree(self.commit_error, f"committing checkpoint {self.tag_dir} (async)")
            except BaseException:
                self.discard()  # every rank's writer has finished
                raise
        elif self.write_error is not None or self.commit_error is not None:
            raise self.write_error or self.commit_error  # type: ignore[misc]


_PENDING: SaveJob | None = None
_LOCK = threading.Lock()


def pending_job() -> SaveJob | None:
    return _PENDING


def set_pending(job: SaveJob) -> None:
    global _PENDING
    with _LOCK:
        _PENDING = job


def wait_pending(collective: bool = True) -> None:
    """Finish the previous async save, if any (collective: every rank must call it)."""
    global _PENDING
    with _LOCK:
        job, _PENDING = _PENDING, None
    if job is not None:
        job.finish(collective)


def _wait_at_exit() -> None:
    try:
        wait_pending(collective=False)
    except BaseException:
        logger.exception("the last asynchronous checkpoint save failed")


def _forget_pending() -> None:
    """A forked child does not own its parent's background save."""
    global _PENDING, _LOCK
    _PENDING, _LOCK = None, threading.Lock()


atexit.register(_wait_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pending)
