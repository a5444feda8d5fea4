"""Tag folders: markers, finding the newest complete tag, and deleting old ones safely.

A tag is *complete* when its ``done`` marker exists; ``done`` is written only after the index
names a fully written save. Tags are ordered by the time written inside ``done`` (nanoseconds
since the epoch; a re-save rewrites it), or its modification time for markers that hold no
time (older saves, NxD's); ties by name. The recorded time matters because file timestamps
on Linux tick at the kernel's coarse clock (a few milliseconds), so quick saves could tie.
Deleting a tag removes ``done`` first, then the files, then the
folders, so an interrupted deletion never leaves a tag that looks complete.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from nxd_ckpt._stfile import fsync_dir, write_text_atomic
from nxd_ckpt.format import DONE_MARKER, INDEX_NAME, START_MARKER

__all__ = [
    "TagInfo",
    "apply_num_kept",
    "list_tags",
    "newest_complete_tag",
    "remove_tag",
    "resolve_tag_dir",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TagInfo:
    name: str
    path: Path
    complete: bool
    order: tuple[int, str]
    """(time of ``done``, or of the ``checkpoint`` marker when incomplete, in ns; name)."""


def _stamp(path: Path) -> int:
    """The time recorded in a marker (ns), else its modification time; 0 when it is gone."""
    try:
        text = path.read_text().strip()
        recorded = int(text) if text.isdigit() else 0
        # "1" (older markers) is no time: anything before 2001 falls back to the mtime.
        return recorded if recorded > 10**18 else path.stat().st_mtime_ns
    except (FileNotFoundError, UnicodeDecodeError):
        return 0


def list_tags(path: Path) -> list[TagInfo]:
    """Sub-folders of ``path`` that hold a checkpoint (a start marker or ``done``), oldest
    first; ``path`` itself too when it is one (the tag ``""``)."""
    found = []
    candidates = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if (path / START_MARKER).exists() or (path / DONE_MARKER).exists():
        candidates.append(path)
    for folder in candidates:
        done = folder / DONE_MARKER
        start = folder / START_MARKER
        if not (done.exists() or start.exists()):
            continue
        complete = done.exists()
        name = "" if folder == path else folder.name
        stamp = _stamp(done) if complete else _stamp(start)
        found.append(TagInfo(name, folder, complete, (stamp, name)))
    return sorted(found, key=lambda tag: tag.order)


def newest_complete_tag(path: Path) -> TagInfo | None:
    complete = [tag for tag in list_tags(path) if tag.complete]
    return complete[-1] if complete else None


def resolve_tag_dir(path: str | os.PathLike[str], tag: str | None) -> tuple[Path, str]:
    """The folder of ``tag`` under ``path`` (newest complete tag when None), checked to be a
    complete checkpoint: clear errors for a missing path, tag or ``done``."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint path {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"checkpoint path {root} is not a folder")
    if tag is None:
        newest = newest_complete_tag(root)
        if newest is None:
            incomplete = [t.name for t in list_tags(root) if not t.complete]
            hint = f" (tags without '{DONE_MARKER}': {incomplete})" if incomplete else ""
            raise FileNotFoundError(f"no complete checkpoint tag under {root}{hint}")
        return newest.path, newest.name
    folder = root / tag if tag else root
    if not folder.is_dir():
        known = [t.name for t in list_tags(root)]
        raise FileNotFoundError(f"checkpoint tag {tag!r} not found under {root}; tags: {known}")
    if not (folder / DONE_MARKER).exists():
        raise RuntimeError(
            f"checkpoint tag {tag!r} at {folder} is incomplete: it has no '{DONE_MARKER}' "
            f"marker (the save was interrupted or is still running)"
        )
    return folder, tag


def begin_tag(folder: Path) -> None:
    """Create the tag folder and its start marker (kept if the tag exists)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / START_MARKER).exists():  # informational: not worth an fsync
        write_text_atomic(folder / START_MARKER, str(time.time_ns()), durable=False)


def mark_done(folder: Path) -> None:
    """``done`` holding the completion time (ns), made durable by a folder fsync (the index
    it vouches for was made durable before)."""
    write_text_atomic(folder / DONE_MARKER, str(time.time_ns()), durable=False)
    fsync_dir(folder)


def remove_tag(folder: Path) -> None:
    """Delete a tag: ``done`` first (made durable), then everything else."""
    done = folder / DONE_MARKER
    if done.exists():
        done.unlink()
        fsync_dir(folder)
    for child in sorted(folder.iterdir()):
        if child.name == START_MARKER:
            continue
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    shutil.rmtree(folder)


def apply_num_kept(path: Path, num_kept: int | None) -> list[str]:
    """Keep the newest ``num_kept`` complete tags; also remove incomplete tags older than
    every complete one (left by an interrupted deletion). Newer incomplete tags (an
    interrupted save, to be redone) stay. Returns the removed tag names."""
    tags = list_tags(path)
    removed = []
    complete = [t for t in tags if t.complete]
    stale = []
    if complete:
        oldest_complete = complete[0].order
        stale = [t for t in tags if not t.complete and t.order < oldest_complete and t.name]
    excess = complete[: max(0, len(complete) - num_kept)] if num_kept is not None else []
    for tag in [*stale, *excess]:
        if not tag.name:  # never delete the root folder itself
            continue
        logger.info("removing checkpoint tag %s (num_kept_ckpts=%s)", tag.path, num_kept)
        remove_tag(tag.path)
        removed.append(tag.name)
    return removed


def remove_stale_data(folder: Path, keep: str) -> None:
    """Remove ``data-*`` folders of ``folder`` other than ``keep`` (older or failed saves)."""
    for child in folder.iterdir():
        if child.is_dir() and child.name.startswith("data-") and child.name != keep:
            shutil.rmtree(child, ignore_errors=True)
    for leftover in (folder / f"{INDEX_NAME}.tmp", folder / f"{DONE_MARKER}.tmp"):
        if leftover.exists():
            leftover.unlink()
