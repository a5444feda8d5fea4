"""One save, synchronous or in the background, and its commit.

A :class:`SaveJob` has two phases. *Write*: this rank's data file and manifest (under a host
slot, ``num_workers`` per host). *Commit* (rank 0 only): wait until every rank's manifest
exists, merge them into ``index.json`` (atomic replace: the commit point), write ``done``,
remove data of older saves of the tag and apply ``num_kept_ckpts``. Once ``done`` is written
the save has succeeded: a problem while cleaning up or removing old tags is a
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nxd_ckpt.format import DONE_MARKER, INDEX_NAME, _tags
from nxd_ckpt.format._contain import real_dir
from nxd_ckpt.format._slots import host_slot
from nxd_ckpt.format._stfile import FilePlan, write_text_atomic
from nxd_ckpt.layout._context import RankContext, agree
from nxd_ckpt.save import _step_gate
from nxd_ckpt.save._plan import RankPlan
from nxd_ckpt.save._write import (
    DeferredCopy,
    copy_deferred,
    manifest_path,
    merge_manifests,
    write_rank,
)

__all__ = ["SaveJob", "pending_job", "wait_pending"]

logger = logging.getLogger(__name__)
_COMMIT_POLL_S = 0.01


class SaveAborted(RuntimeError):
    """Rank 0 stopped waiting for the other ranks' manifests (a rank failed)."""


@dataclass
class SaveJob:
    root: Path
    tag: str
    tag_dir: Path
    data_dir: Path
    save_id: str
    plan: RankPlan
    num_kept: int | None
    num_workers: int
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

    # Phases ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Rank 0 creates the tag and its start marker; every rank its data folder."""
        if self.ctx.rank == 0:
            _tags.begin_tag(self.tag_dir, self.tag)
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        try:
            try:  # the deferred copy first (no I/O before it): the next step waits for it
                if self.deferred:
                    copy_deferred(self.deferred)
            finally:
                self.deferred = None
                _step_gate.open_gate()
            self.prepare()
            with host_slot(self.num_workers, self.ctx.local_rank, f"rank {self.ctx.rank} save"):
                write_rank(self.plan, self.tag_dir, self.data_dir, self.file_plan, self.staged)
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
        """Rank 0: merge the manifests into the index, mark the tag done, clean up."""
        try:
            self._wait_for_manifests()
            index = merge_manifests(
                self.data_dir,
                self.ctx.world_size,
                self.tag,
                self.save_id,
                self.plan.meta.get("parallel", {}),
            )
            write_text_atomic(self.tag_dir / INDEX_NAME, index.to_json())
            _tags.mark_done(self.tag_dir)
        except BaseException as error:
            self.commit_error = error
            return
        try:  # committed: what follows is cleanup, whose problems are warnings
            _tags.remove_stale_data(self.tag_dir, keep=self.data_dir.name)
            if self.num_kept is not None:
                _tags.apply_num_kept(self.root, self.num_kept)
        except Exception as error:
            _tags.retention_warning(
                f"checkpoint {self.tag_dir} was saved, but removing old data or tags "
                f"(num_kept_ckpts={self.num_kept}) failed: {type(error).__name__}: {error}"
            )
        logger.info(
            "checkpoint %s complete (%.2fs, %d files)",
            self.tag_dir,
            time.perf_counter() - self.started,
            len(index.files),
        )

    def _wait_for_manifests(self) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        missing = list(range(self.ctx.world_size))
        while missing:
            failed = sorted(self.data_dir.glob("failed_rank_*"))
            if failed or self.cancel.is_set():
                names = [p.name for p in failed]
                raise SaveAborted(f"save of {self.tag_dir} abandoned: failed ranks {names}")
            missing = [r for r in missing if not manifest_path(self.data_dir, r).exists()]
            if missing:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"save of {self.tag_dir}: ranks {missing} wrote no manifest within "
                        f"{self.commit_timeout_s:.0f}s"
                    )
                time.sleep(_COMMIT_POLL_S)

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
