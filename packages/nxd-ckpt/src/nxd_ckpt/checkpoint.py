"""NxD's ``save_checkpoint`` / ``load_checkpoint`` on the nxd-ckpt format.

``save_checkpoint(path, tag, model=…, optimizer=…, scheduler=…, user_content=…)`` writes the
tag folder described in :mod:`nxd_ckpt.format`; every rank must call it. ``load_checkpoint``
reads it back into a model and optimizer at any TP/PP/DP degrees and ZeRO-1 setting and
returns the user content. NxD's checkpoint folders (pickled ``.pt`` files) are read too, with
``torch.load(weights_only=True)`` (:mod:`nxd_ckpt.nxd_format`).
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
from nxd_ckpt.layout._context import agree, broadcast_int, current_context
from nxd_ckpt.load._load_model import load_json, model_reads, rng_names
from nxd_ckpt.load._optim_load import optimizer_reads
from nxd_ckpt.load._preflight import verify_reads
from nxd_ckpt.load._reader import CheckpointReader
from nxd_ckpt.load._restore import apply_scheduler
from nxd_ckpt.save import _saver
from nxd_ckpt.save._plan import build_plan
from nxd_ckpt.save._write import StagingBuffer, file_plan_for

__all__ = ["finalize_checkpoint", "has_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)
_STAGING = StagingBuffer()
_ASYNC_COPY = ("before_return", "before_step")


def _check_num_workers(num_workers: Any) -> int:
    if (
        isinstance(num_workers, bool)
        or not isinstance(num_workers, int)
        or not (1 <= num_workers <= 32)
    ):
        raise ValueError(f"num_workers must be an int in [1, 32] (NxD's), got {num_workers!r}")
    return num_workers


def _check_save_args(path: Any, tag: Any, num_kept_ckpts: Any) -> tuple[Path, str]:
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
    return root, tag


def save_checkpoint(
    path: str | os.PathLike[str],
    tag: str = "",
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    num_workers: int = 8,
    use_xser: bool = False,
    num_kept_ckpts: int | None = None,
    async_save: bool = False,
    zero1_optimizer: bool = False,
    *,
    async_copy: str = "before_return",
) -> None:
    """Save a checkpoint tag (collective: every rank calls it with the same arguments).

    ``model``: an ``nn.Module`` (``NxDPPModel`` included) or a state dict; ``optimizer``: a
    ``torch.optim`` optimizer, ``NxDOptimizer`` or ``NeuronZero1Optimizer`` (state saved by
    parameter name, which needs ``model``); ``scheduler``: anything with ``state_dict``;
    ``user_content``: dicts/lists/numbers/strings/tensors (no pickle). ``num_workers``: at most
    that many ranks per host write at once (1-32). ``use_xser`` is accepted for NxD
    compatibility: this format always writes tensor by tensor. ``num_kept_ckpts``: keep the
    newest N complete tags. ``async_save``: copy the state to host memory now and write it in
    a background thread; the next save, :func:`finalize_checkpoint`, ``load_checkpoint`` and
    interpreter exit wait for it, and raise its error if it failed. ``zero1_optimizer`` is
    accepted for NxD compatibility (ZeRO-1 is detected from the optimizer).

    ``async_copy`` (nxd's, with ``async_save``): when the copy to host memory is complete.
    ``"before_return"`` (default): before this call returns, so any later change is safe.
    ``"before_step"``: parameters and optimizer state (on CPU) are copied by the background
    thread and the next ``optimizer.step()`` of any ``torch.optim`` optimizer waits for that
    copy; buffers, RNG states and user content are copied now. A parameter or state tensor
    changed in place outside an optimizer step before the copy is detected (version
    counters) and fails the save with its name; a change through ``.data`` is not seen.
    """
    del use_xser, zero1_optimizer  # see the docstring
    ctx = current_context()
    # Checks that need no peer, before any traffic: every rank gets the same arguments, so
    # every rank raises the same error and none is left waiting in a collective. (A folder
    # writable on some hosts only fails there; its peers then stop at the collective timeout.)
    if async_copy not in _ASYNC_COPY:
        raise ValueError(f"async_copy must be one of {_ASYNC_COPY}, got {async_copy!r}")
    _check_num_workers(num_workers)
    root, tag = _check_save_args(path, tag, num_kept_ckpts)
    if user_content is not None:  # the no-pickle check of the content (plan builds it later)
        _jsonstate.encode(user_content, {}, "user_content", "user_content")
    _saver.wait_pending()
    save_id = f"{broadcast_int(secrets.randbits(62)):016x}"
    tag_dir = root / tag if tag else root
    data_dir = tag_dir / f"data-{save_id}"
    started = time.perf_counter()
    error = None
    try:  # plan first (no I/O): bad content fails before anything is created
        _tags.check_save_target(tag_dir, tag)  # no link, nobody else's folder
        plan = build_plan(
            ctx, model=model, optimizer=optimizer, scheduler=scheduler, user_content=user_content
        )
        zero1 = bool(plan.meta.get("optimizer", {}).get("zero1"))
        plan.meta["parallel"] = ctx.parallel_dict(zero1)
    except BaseException as caught:
        error = caught
    agree(error, f"preparing checkpoint {tag_dir}")
    job = _saver.SaveJob(root, tag, tag_dir, data_dir, save_id, plan, num_kept_ckpts, num_workers)
    if not async_save:
        job.run_sync()
        logger.info(
            "saved %s in %.2fs (%d bytes on rank %d)",
            tag_dir,
            time.perf_counter() - started,
            plan.nbytes,
            ctx.rank,
        )
        return
    job.file_plan = file_plan_for(plan)
    defer = async_copy == "before_step"
    job.staged, job.deferred = [], []
    if plan.chunks:
        job.staged, job.deferred = _STAGING.stage(plan, job.file_plan, defer=defer)
    job.start_async()
    _saver.set_pending(job)
    logger.info(
        "staged %s for async save in %.3fs (%d bytes on rank %d)",
        tag_dir,
        time.perf_counter() - started,
        plan.nbytes,
        ctx.rank,
    )


def finalize_checkpoint(*, release_host_memory: bool = True) -> None:
    """Wait for a pending async save and raise its error (collective). The host buffer async
    saves copy into is kept between saves (so the next copy does not page-fault), and freed
    here unless ``release_host_memory=False``."""
    _saver.wait_pending()
    if release_host_memory:
        _STAGING.release()


def has_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds at least one complete tag."""
    root = Path(path)
    return root.is_dir() and _tags.newest_complete_tag(root) is not None


def remove_checkpoint(path: str | os.PathLike[str], tag: str) -> bool:
    """Delete tag ``tag`` of checkpoint folder ``path`` if nxd-ckpt wrote it (``done`` first,
    so an interrupted deletion never leaves a tag that looks complete). Not collective: call
    it on one rank. Returns False when there is nothing at ``path/tag``. ``tag`` must be a
    plain name inside ``path``; a link (ContainmentError), a file (NotADirectoryError) or a
    folder without nxd-ckpt's marker or index (ValueError) is refused and left as it is."""
    folder = Path(path) / check_tag(tag)
    if not os.path.lexists(folder):
        return False
    _tags.remove_tag(folder)
    return True


def load_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    num_workers: int = 8,
    strict: bool = True,
    *,
    allow_pickle: bool = False,
    load_rng: bool = True,
) -> Any:
    """Load tag ``tag`` (None: the newest complete one) into ``model``, ``optimizer`` and
    ``scheduler``; return the user content (None if none was saved). Collective.

    Any TP/PP/DP degrees and ZeRO-1 setting load any checkpoint: each rank reads the boxes
    its local tensors need. ``strict``: missing or unexpected model/optimizer names are an
    error (listed). NxD-layout folders (``model/*.pt`` …) are read with
    ``torch.load(weights_only=True)``; their pickled user content and scheduler only with
    ``allow_pickle=True`` (which executes code from the files: trusted checkpoints only).
    ``load_rng``: restore the RNG states when the layout is the one saved.
    """
    _check_num_workers(num_workers)
    _saver.wait_pending()
    ctx = current_context()
    tag_dir, _ = _tags.resolve_tag_dir(path, tag)
    if not os.path.lexists(tag_dir / INDEX_NAME):  # (a link is refused by the reader)
        from nxd_ckpt.nxd_format import is_nxd_checkpoint, load_nxd_checkpoint

        if is_nxd_checkpoint(tag_dir):
            return load_nxd_checkpoint(
                tag_dir,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                strict=strict,
                allow_pickle=allow_pickle,
            )
        raise FileNotFoundError(
            f"{tag_dir} has no {INDEX_NAME} and is not in NxD's layout: not a checkpoint"
        )
    if optimizer is not None and model is None:
        logger.info("loading optimizer state without model=: parameters are matched by position")
    with CheckpointReader(tag_dir) as reader:
        return _load_native(reader, ctx, model, optimizer, scheduler, num_workers, strict, load_rng)


def _load_native(
    reader: CheckpointReader,
    ctx: Any,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    num_workers: int,
    strict: bool,
    load_rng: bool,
) -> Any:
    """Plan, check, then apply (see :func:`load_checkpoint`): nothing is changed until every
    check passed on every rank."""
    tag_dir = reader.tag_dir

    def slot() -> Any:  # reading only: never held across a collective
        return host_slot(num_workers, ctx.local_rank, f"rank {ctx.rank} load")

    # 1. Match names, shapes and types (collective key checks).
    model_part = model_reads(model, reader, ctx, strict) if model is not None else None
    optim_part = None
    if optimizer is not None:
        optim_part = optimizer_reads(optimizer, model, reader, ctx, strict)
    agree(_scheduler_problem(reader, scheduler), "loading the scheduler")
    rng = rng_names(reader, ctx) if load_rng else []

    # 2. Check every byte this rank will copy into the model (sizes, headers, CRCs), and read
    # (and check) the optimizer state, scheduler state, user content and RNG states into new
    # objects; then agree (collective): a problem on any rank stops every rank here, with
    # nothing changed (see _preflight).
    loaded: dict[str, Any] = {}

    def prepare() -> None:
        if optim_part is not None:
            loaded["optimizer"] = optim_part.prepare()
        if scheduler is not None:
            loaded["scheduler"] = load_json(reader, "scheduler")
        if rng:
            prefix = f"rank{ctx.rank:05d}/"
            loaded["rng"] = {n[len(prefix) :]: reader.read_full("rng", n) for n in rng}
        has_content = reader.index.has_user_content
        loaded["content"] = load_json(reader, "user_content") if has_content else None

    boxes = model_part.boxes() if model_part is not None else iter(())
    with slot():
        checked = verify_reads(reader, boxes, then=prepare)
    logger.debug("checked %d boxes of %s on rank %d", checked, tag_dir, ctx.rank)

    # 3. Apply: the scheduler first (restored if anything after it fails), the model, the
    # optimizer, the RNG states.
    restore = apply_scheduler(scheduler, loaded.get("scheduler"), str(tag_dir))
    try:
        if model_part is not None:
            with slot():
                model_part.fill(reader)
        if optim_part is not None:
            loaded["optimizer"]()
    except BaseException:
        restore()
        raise
    if rng:
        import nxd_state

        nxd_state.load_rng_state_dict(loaded["rng"])
    logger.info("loaded %s (%d bytes read on rank %d)", tag_dir, reader.bytes_read, ctx.rank)
    return loaded["content"]


def _scheduler_problem(reader: CheckpointReader, scheduler: Any) -> BaseException | None:
    if scheduler is None:
        return None
    index = reader.index
    if not index.has_scheduler:
        return ValueError(f"{reader.tag_dir} holds no scheduler state (saved without scheduler=)")
    saved, current = index.scheduler_class, type(scheduler).__name__
    if saved is not None and saved != current:
        return ValueError(
            f"{reader.tag_dir}: its scheduler state was saved from {saved}, this scheduler "
            f"is {current}: state of another scheduler type is not loaded (nothing was loaded)"
        )
    return None
