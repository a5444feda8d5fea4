"""One load of an nxd-ckpt tag, top to bottom: what :func:`nxd_ckpt.load_checkpoint` does
once it has opened the tag's :class:`~nxd_ckpt.load._reader.CheckpointReader`.

1. :func:`match`: the names, shapes and types the model, optimizer and scheduler need against
   the index (collective key checks), and the RNG states to restore.
2. :func:`check_and_read`: every byte this rank will copy into the model is checked (sizes,
   headers, CRCs), and the optimizer state, scheduler state, user content and RNG states are
   read (and checked) into new objects; then the ranks agree. A problem on any rank stops
   every rank here, with nothing changed (:mod:`nxd_ckpt.load._preflight`).
3. :func:`apply`: the scheduler first (put back if anything after it fails), the model, the
   optimizer, the RNG states.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxd_ckpt.format import INDEX_NAME, FormatError
from nxd_ckpt.format._slots import host_slot
from nxd_ckpt.layout._context import RankContext, agree, broadcast_int
from nxd_ckpt.load._load_model import ModelReads, load_json, model_reads, rng_names
from nxd_ckpt.load._optim_load import OptimizerReads, optimizer_reads
from nxd_ckpt.load._preflight import verify_reads
from nxd_ckpt.load._reader import CheckpointReader
from nxd_ckpt.load._restore import apply_scheduler
from nxd_state.shards import json_checkpoint_state

__all__ = ["load_native", "open_tag"]

logger = logging.getLogger(__name__)


def open_tag(tag_dir: Path) -> CheckpointReader | None:
    """The reader of ``tag_dir``'s index, the same save on every rank, or None on every rank
    when the tag has no index (NxD's layout, or no checkpoint). Collective.

    Each rank reads the index itself, so a save committing into the same tag while the ranks
    open it (another job re-saving it, or saving it for the first time) could give ranks
    different saves: a load mixing two checkpoints, or ranks that leave before a collective
    their peers wait in. So the ranks compare (tag name, save id) with rank 0's and all raise
    if any differs, naming both."""
    reader, error = None, None
    try:
        if os.path.lexists(tag_dir / INDEX_NAME):  # (a link is refused by the reader)
            reader = CheckpointReader(tag_dir)
    except Exception as caught:  # every rank raises: none waits in the broadcast below
        error = caught
    agree(error, f"reading {tag_dir / INDEX_NAME}")
    save = f"save {reader.index.save_id}" if reader is not None else f"no {INDEX_NAME}"
    digest = hashlib.blake2b(f"{tag_dir.name}\0{save}".encode(), digest_size=8).digest()
    mine = int.from_bytes(digest, "big") >> 2  # 62 bits: broadcast_int carries 63
    problem = None
    if broadcast_int(mine) != mine:
        problem = FormatError(
            f"{tag_dir}: this rank read {save} but rank 0 another: the tag changed while the "
            f"ranks opened it (a save into the same tag?); nothing was loaded"
        )
    try:
        agree(problem, f"opening {tag_dir}")
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    return reader


@dataclass
class Reads:
    """What a load takes from a tag, matched against its index (step 1)."""

    model: ModelReads | None
    optimizer: OptimizerReads | None
    rng: list[str]
    """The stored RNG states of this rank (empty: not restored)."""


def load_native(
    reader: CheckpointReader,
    ctx: RankContext,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    num_workers: int,
    strict: bool,
    load_rng: bool,
) -> Any:
    """Load ``reader``'s tag into the objects given; return its user content (collective)."""

    def slot() -> AbstractContextManager[Any]:  # reading only: never held across a collective
        return host_slot(num_workers, ctx.local_rank, f"rank {ctx.rank} load")

    reads = match(reader, ctx, model, optimizer, scheduler, strict, load_rng)
    loaded = check_and_read(reader, ctx, reads, scheduler is not None, slot)
    apply(reader, reads, loaded, scheduler, slot)
    logger.info("loaded %s (%d bytes read on rank %d)", reader.tag_dir, reader.bytes_read, ctx.rank)
    return loaded["content"]


def match(
    reader: CheckpointReader,
    ctx: RankContext,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    strict: bool,
    load_rng: bool,
) -> Reads:
    """Step 1: match names, shapes and types (collective key checks)."""
    model_part = model_reads(model, reader, ctx, strict) if model is not None else None
    optim_part = None
    if optimizer is not None:
        optim_part = optimizer_reads(optimizer, model, reader, ctx, strict)
    agree(_scheduler_problem(reader, scheduler), "loading the scheduler")
    return Reads(model_part, optim_part, rng_names(reader, ctx) if load_rng else [])


def check_and_read(
    reader: CheckpointReader,
    ctx: RankContext,
    reads: Reads,
    with_scheduler: bool,
    slot: Callable[[], AbstractContextManager[Any]],
) -> dict[str, Any]:
    """Step 2: check every box the model will copy and read everything else into new
    objects (``optimizer``: the call applying its state; ``scheduler``, ``rng``,
    ``content``), then agree across ranks (collective)."""
    loaded: dict[str, Any] = {}

    def prepare() -> None:
        if reads.optimizer is not None:
            loaded["optimizer"] = reads.optimizer.prepare()
        if with_scheduler:
            loaded["scheduler"] = load_json(reader, "scheduler")
        if reads.rng:
            prefix = f"rank{ctx.rank:05d}/"
            loaded["rng"] = {n[len(prefix) :]: reader.read_full("rng", n) for n in reads.rng}
        has_content = reader.index.has_user_content
        loaded["content"] = load_json(reader, "user_content") if has_content else None

    boxes = reads.model.boxes() if reads.model is not None else iter(())
    with slot():
        checked = verify_reads(reader, boxes, then=prepare)
    logger.debug("checked %d boxes of %s on rank %d", checked, reader.tag_dir, ctx.rank)
    return loaded


def apply(
    reader: CheckpointReader,
    reads: Reads,
    loaded: dict[str, Any],
    scheduler: Any,
    slot: Callable[[], AbstractContextManager[Any]],
) -> None:
    """Step 3: the scheduler (put back if what follows fails), the model, the optimizer,
    the RNG states."""
    restore = apply_scheduler(scheduler, loaded.get("scheduler"), str(reader.tag_dir))
    try:
        if reads.model is not None:
            with slot():
                reads.model.fill(reader)
        if reads.optimizer is not None:
            loaded["optimizer"]()
    except BaseException:
        restore()
        raise
    if reads.rng:
        import nxd_state

        nxd_state.load_rng_state_dict(loaded["rng"])


def _scheduler_problem(reader: CheckpointReader, scheduler: Any) -> BaseException | None:
    """Why ``scheduler`` cannot take the tag's scheduler state (it has no checkpoint state,
    none was saved, or it was saved from another class), or None."""
    if scheduler is None:
        return None
    try:
        json_checkpoint_state(scheduler)
    except TypeError as error:
        return error
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
