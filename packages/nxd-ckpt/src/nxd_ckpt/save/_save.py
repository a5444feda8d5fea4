"""One save, top to bottom: what :func:`nxd_ckpt.save_checkpoint` does, step by step.

1. :func:`check_arguments`, on every rank before any traffic (every rank gets the same
   arguments, so every rank raises the same error and none waits in a collective): the tag
   stays inside the folder, the folder is writable, the user content holds no pickle.
2. :func:`plan_rank`: this rank's chunks and declarations, from one walk of the model
   (:func:`~nxd_ckpt.save._plan.build_plan`); the ranks agree that every plan was built.
3. :func:`stage_to_host` (``async_save`` only): copy the chunks into the host buffer, so the
   caller may change its tensors once this call returns (``"before_step"``: the parameters and
   optimizer state are copied by the background thread before the next optimizer step).
4. :func:`write_files`, every rank: its safetensors file, a CRC per block, and its manifest
   (:func:`~nxd_ckpt.save._write.write_rank`), under a host slot (``num_workers`` per host).
5. :func:`commit`, rank 0, once every manifest exists: merge the manifests
   (:func:`~nxd_ckpt.save._write.merge_manifests`), replace ``index.json`` atomically (the
   commit point), write ``done``, then :func:`remove_previous_data` (whose problems are
   warnings: the save has succeeded).

Steps 4 and 5 run in a :class:`~nxd_ckpt.save._saver.SaveJob`: synchronously, the ranks agree
on the write before rank 0 commits and on the commit before returning; with ``async_save``, in
a background thread that the next save, ``finalize_checkpoint`` or ``load_checkpoint`` joins.
A save that fails removes only its own ``data-*`` folder: the previous checkpoint stays.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from nxd_ckpt.format import INDEX_NAME, _jsonstate, _tags
from nxd_ckpt.format._contain import check_tag
from nxd_ckpt.format._slots import host_slot
from nxd_ckpt.format._stfile import write_text_atomic
from nxd_ckpt.layout._context import RankContext, agree, broadcast_int, current_context
from nxd_ckpt.save import _saver, _step_gate
from nxd_ckpt.save._plan import RankPlan, build_plan
from nxd_ckpt.save._saver import SaveJob
from nxd_ckpt.save._write import (
    StagingBuffer,
    copy_deferred,
    file_plan_for,
    manifest_path,
    merge_manifests,
    write_rank,
)

__all__ = ["ASYNC_COPY", "STAGING", "SaveAborted", "check_num_workers", "save"]

logger = logging.getLogger(__name__)
STAGING = StagingBuffer()
"""The host buffer async saves copy into, kept between saves (``finalize_checkpoint`` frees it)."""
ASYNC_COPY = ("before_return", "before_step")
_COMMIT_POLL_S = 0.01


class SaveAborted(RuntimeError):
    """Rank 0 stopped waiting for the other ranks' manifests (a rank failed)."""


def save(
    path: str | os.PathLike[str],
    tag: str,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    user_content: Any,
    num_workers: int,
    num_kept_ckpts: int | None,
    async_save: bool,
    async_copy: str,
) -> None:
    """Save tag ``tag`` of folder ``path`` (collective; see :func:`nxd_ckpt.save_checkpoint`)."""
    ctx = current_context()
    root, tag = check_arguments(path, tag, user_content, num_workers, num_kept_ckpts, async_copy)
    _saver.wait_pending()  # one save in flight at a time
    started = time.perf_counter()
    save_id = f"{broadcast_int(secrets.randbits(62)):016x}"
    tag_dir = root / tag if tag else root
    data_dir = tag_dir / f"data-{save_id}"
    plan = plan_rank(
        ctx,
        tag_dir,
        tag,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        user_content=user_content,
    )
    job = SaveJob(
        root,
        tag,
        tag_dir,
        data_dir,
        save_id,
        plan,
        num_kept_ckpts,
        num_workers,
        write_step=write_files,
        commit_step=commit,
    )
    if async_save:
        stage_to_host(job, defer=async_copy == "before_step")
        job.start_async()  # write_files, then commit on rank 0, in a background thread
        _saver.set_pending(job)
        what = "staged %s for async save in %.3fs (%d bytes on rank %d)"
    else:
        job.run_sync()  # write_files, agree, commit on rank 0, agree
        what = "saved %s in %.2fs (%d bytes on rank %d)"
    logger.info(what, tag_dir, time.perf_counter() - started, plan.nbytes, ctx.rank)


# 1. Arguments ------------------------------------------------------------------------------
def check_num_workers(num_workers: Any) -> int:
    """``num_workers`` (NxD's): how many ranks per host read or write at once, 1-32."""
    if (
        isinstance(num_workers, bool)
        or not isinstance(num_workers, int)
        or not (1 <= num_workers <= 32)
    ):
        raise ValueError(f"num_workers must be an int in [1, 32] (NxD's), got {num_workers!r}")
    return num_workers


def check_arguments(
    path: Any,
    tag: Any,
    user_content: Any,
    num_workers: Any,
    num_kept_ckpts: Any,
    async_copy: Any,
) -> tuple[Path, str]:
    """The checkpoint folder (created, writable) and the tag (a plain name inside it), checked
    without any peer. (A folder writable on some hosts only fails there; its peers then stop
    at the next collective's timeout.)"""
    if async_copy not in ASYNC_COPY:
        raise ValueError(f"async_copy must be one of {ASYNC_COPY}, got {async_copy!r}")
    check_num_workers(num_workers)
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path must be a non-empty str or path, got {path!r}")
    tag = check_tag("" if tag is None else str(tag))
    if num_kept_ckpts is not None and (
        isinstance(num_kept_ckpts, bool)
        or not isinstance(num_kept_ckpts, int)
        or num_kept_ckpts < 1
    ):
        raise ValueError(f"num_kept_ckpts must be None or an int >= 1, got {num_kept_ckpts!r}")
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "no write permission")
    except OSError as error:
        raise PermissionError(
            f"checkpoint path {root} is not a writable folder: {error.strerror or error}"
        ) from error
    if user_content is not None:  # the no-pickle check of the content (the plan builds it)
        _jsonstate.encode(user_content, {}, "user_content", "user_content")
    return root, tag


# 2. Plan -----------------------------------------------------------------------------------
def plan_rank(ctx: RankContext, tag_dir: Path, tag: str, **objects: Any) -> RankPlan:
    """This rank's :class:`~nxd_ckpt.save._plan.RankPlan` of ``objects`` (model, optimizer,
    scheduler, user content) and the layout it was saved under. No I/O: bad content fails
    here, before anything is created; a failure on any rank stops every rank (collective)."""
    plan, error = None, None
    try:
        _tags.check_save_target(tag_dir, tag)  # no link, nobody else's folder
        plan = build_plan(ctx, **objects)
        zero1 = bool(plan.meta.get("optimizer", {}).get("zero1"))
        plan.meta["parallel"] = ctx.parallel_dict(zero1)
    except BaseException as caught:
        error = caught
    agree(error, f"preparing checkpoint {tag_dir}")
    assert plan is not None
    return plan


# 3. Stage to host (async) ------------------------------------------------------------------
def stage_to_host(job: SaveJob, *, defer: bool) -> None:
    """Copy the plan's chunks into :data:`STAGING`, in file order. With ``defer``, the CPU
    chunks only optimizer steps change are left to the background thread
    (:func:`finish_staging`), and the next optimizer step waits for them."""
    job.file_plan = file_plan_for(job.plan)
    job.staged, job.deferred = [], []
    if job.plan.chunks:
        job.staged, job.deferred = STAGING.stage(job.plan, job.file_plan, defer=defer)


def finish_staging(job: SaveJob) -> None:
    """The deferred copies of :func:`stage_to_host`, checked to be a snapshot; then the next
    optimizer step may run (also when the copy failed: steps must not wait forever)."""
    try:
        if job.deferred:
            copy_deferred(job.deferred)
    finally:
        job.deferred = None
        _step_gate.open_gate()


# 4. Write (every rank) ---------------------------------------------------------------------
def write_files(job: SaveJob) -> None:
    """This rank's data file and manifest in the save's ``data-<id>`` folder (rank 0 creates
    the tag folder and its start marker first)."""
    finish_staging(job)  # before any I/O: the next optimizer step waits for it
    ctx = job.ctx
    if ctx.rank == 0:
        _tags.begin_tag(job.tag_dir, job.tag)
    job.data_dir.mkdir(parents=True, exist_ok=True)
    with host_slot(job.num_workers, ctx.local_rank, f"rank {ctx.rank} save"):
        write_rank(job.plan, job.tag_dir, job.data_dir, job.file_plan, job.staged)


# 5. Commit (rank 0) ------------------------------------------------------------------------
def commit(job: SaveJob) -> None:
    """Merge every rank's manifest into the index, replace ``index.json`` atomically (the
    commit point), mark the tag ``done``, then remove what the save replaced."""
    wait_for_manifests(job)
    index = merge_manifests(
        job.data_dir, job.ctx.world_size, job.tag, job.save_id, job.plan.meta.get("parallel", {})
    )
    write_text_atomic(job.tag_dir / INDEX_NAME, index.to_json())
    _tags.mark_done(job.tag_dir)
    remove_previous_data(job)
    logger.info(
        "checkpoint %s complete (%.2fs, %d files)",
        job.tag_dir,
        time.perf_counter() - job.started,
        len(index.files),
    )


def wait_for_manifests(job: SaveJob) -> None:
    """Until every rank's manifest exists; raises when a rank marked its write failed, the
    save was cancelled, or ``commit_timeout_s`` passed."""
    deadline = time.monotonic() + job.commit_timeout_s
    missing = list(range(job.ctx.world_size))
    while missing:
        failed = sorted(job.data_dir.glob("failed_rank_*"))
        if failed or job.cancel.is_set():
            names = [p.name for p in failed]
            raise SaveAborted(f"save of {job.tag_dir} abandoned: failed ranks {names}")
        missing = [r for r in missing if not manifest_path(job.data_dir, r).exists()]
        if missing:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"save of {job.tag_dir}: ranks {missing} wrote no manifest within "
                    f"{job.commit_timeout_s:.0f}s"
                )
            time.sleep(_COMMIT_POLL_S)


def remove_previous_data(job: SaveJob) -> None:
    """After the commit: the tag's older ``data-*`` folders, then the tags beyond
    ``num_kept_ckpts``. The save has succeeded: a problem here is a warning, never raised."""
    try:
        _tags.remove_stale_data(job.tag_dir, keep=job.data_dir.name)
        if job.num_kept is not None:
            _tags.apply_num_kept(job.root, job.num_kept)
    except Exception as error:
        _tags.retention_warning(
            f"checkpoint {job.tag_dir} was saved, but removing old data or tags "
            f"(num_kept_ckpts={job.num_kept}) failed: {type(error).__name__}: {error}"
        )
