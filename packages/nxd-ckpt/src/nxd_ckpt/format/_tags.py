"""Tag folders: markers, finding the newest complete tag, and deleting old ones safely.

A tag is a real sub-folder (never a link: :mod:`nxd_ckpt.format._contain`) that nxd-ckpt
recognises: it carries the tag marker ``nxd-ckpt.json`` (``{"format": "nxd-ckpt",
"format_version": 1, ...}``, written first into every tag nxd-ckpt creates), or an
``index.json`` (tags written before the marker existed), or NxD's own layout (``model/`` or
``optim/`` files, read but never written or deleted here). Anything else, a TensorFlow model
folder holding a file named ``checkpoint`` or an ETL folder holding ``done`` included, is
not a tag: it is not listed, loaded or deleted.

A tag is *complete* when its ``done`` marker exists; ``done`` is written only after the index
names a fully written save. Tags are ordered by the time written inside ``done`` (nanoseconds
since the epoch; a re-save rewrites it), or its modification time for markers that hold no
time (older saves, NxD's); ties by name. The recorded time matters because file timestamps
on Linux tick at the kernel's coarse clock (a few milliseconds), so quick saves could tie.

**Retention** (``num_kept_ckpts``) deletes only tags nxd-ckpt wrote: those with the tag
marker, and older ones whose ``index.json`` is a valid nxd-ckpt index (format name and
version); a tag it cannot recognise is never deleted. Deleting removes ``done`` first, then
the data, then the index and markers, the tag marker last, so an interrupted deletion never
leaves a tag that looks complete and stays recognisable for the next retention. Nothing is
deleted through a link (a link inside a tag is unlinked, its target untouched). Retention runs
after the new tag committed, and a problem there is a warning, never an error of the save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from nxd_ckpt.format._contain import check_tag, is_regular, read_small, real_dir
from nxd_ckpt.format._index import read_index
from nxd_ckpt.format._nxd_files import is_nxd_checkpoint
from nxd_ckpt.format._records import (
    DONE_MARKER,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    START_MARKER,
    TAG_MARKER,
    ContainmentError,
    FormatError,
)
from nxd_ckpt.format._stfile import fsync_dir, write_text_atomic

__all__ = [
    "RetentionWarning",
    "TagInfo",
    "apply_num_kept",
    "begin_tag",
    "check_save_target",
    "list_tags",
    "mark_done",
    "newest_complete_tag",
    "read_marker",
    "remove_stale_data",
    "remove_tag",
    "resolve_tag_dir",
    "retention_warning",
]

logger = logging.getLogger(__name__)

_NXD_FILES = {START_MARKER, DONE_MARKER, INDEX_NAME, TAG_MARKER}


class RetentionWarning(UserWarning):
    """Removing old tags (``num_kept_ckpts``) failed after the new tag committed."""


@dataclass(frozen=True)
class TagInfo:
    name: str
    path: Path
    complete: bool
    order: tuple[int, str]
    """(time of ``done``, or of the start markers when incomplete, in ns; name)."""
    marked: bool = False
    """Carries nxd-ckpt's tag marker."""
    kind: str = "nxd"
    """``nxd`` (this format) or ``neuronx`` (NxD's own layout: read, never deleted)."""


def read_marker(folder: Path) -> dict | None:
    """The tag marker of ``folder`` when it is nxd-ckpt's (format name and an int version),
    else None (missing, a link, not JSON, another format)."""
    raw = read_small(folder / TAG_MARKER)
    if raw is None:
        return None
    try:
        marker = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_NAME:
        return None
    version = marker.get("format_version")
    return marker if isinstance(version, int) and not isinstance(version, bool) else None


def _stamp(path: Path, fallback: int = 0) -> int:
    """The time recorded in a marker (ns), else its modification time; ``fallback`` when it
    is missing (or a link)."""
    raw = read_small(path, 64)
    if raw is None:
        return fallback
    text = raw.decode("ascii", "replace").strip()
    recorded = int(text) if text.isdigit() else 0
    # "1" (older markers, NxD's) is no time: anything before 2001 falls back to the mtime.
    if recorded > 10**18:
        return recorded
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return fallback


def _tag_info(folder: Path, name: str) -> TagInfo | None:
    marker = read_marker(folder)
    complete = is_regular(folder / DONE_MARKER)
    if marker is not None or is_regular(folder / INDEX_NAME):
        kind = "nxd"
    else:
        if not is_nxd_checkpoint(folder):
            return None  # not a checkpoint (a TensorFlow or ETL folder, ...)
        kind = "neuronx"
    started = marker.get("started_ns") if marker is not None else None
    started = started if isinstance(started, int) and not isinstance(started, bool) else 0
    done, start = folder / DONE_MARKER, folder / START_MARKER
    stamp = _stamp(done) if complete else _stamp(start, started)
    return TagInfo(name, folder, complete, (stamp, name), marker is not None, kind)


def list_tags(path: Path) -> list[TagInfo]:
    """The tags under ``path`` (see the module docstring), oldest first; ``path`` itself too
    when it is one (the tag ``""``). Links and hidden folders are never tags."""
    found = []
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except NotADirectoryError:
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            if entry.is_symlink():
                logger.debug("%s is a symbolic link: not a checkpoint tag", entry.path)
            continue
        info = _tag_info(Path(entry.path), entry.name)
        if info is not None:
            found.append(info)
    if any(is_regular(path / m) for m in (START_MARKER, DONE_MARKER, TAG_MARKER)):
        info = _tag_info(path, "")
        if info is not None:
            found.append(info)
    return sorted(found, key=lambda tag: tag.order)


def newest_complete_tag(path: Path) -> TagInfo | None:
    complete = [tag for tag in list_tags(path) if tag.complete]
    return complete[-1] if complete else None


def _root(path: str | os.PathLike[str]) -> Path:
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint path {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"checkpoint path {root} is not a folder")
    return root


def resolve_tag_dir(path: str | os.PathLike[str], tag: str | None) -> tuple[Path, str]:
    """The folder of ``tag`` under ``path`` (newest complete tag when None), checked to be a
    plain name, a real folder (not a link) and a complete checkpoint: clear errors for a
    bad name, a missing path, tag or ``done``."""
    if tag is not None:
        check_tag(tag)
    root = _root(path)
    if tag is None:
        newest = newest_complete_tag(root)
        if newest is None:
            incomplete = [t.name for t in list_tags(root) if not t.complete]
            hint = f" (tags without '{DONE_MARKER}': {incomplete})" if incomplete else ""
            raise FileNotFoundError(f"no complete checkpoint tag under {root}{hint}")
        return newest.path, newest.name
    folder = root / tag if tag else root
    if tag:
        try:
            real_dir(folder, "checkpoint tag folder")
        except FileNotFoundError:
            known = [t.name for t in list_tags(root)]
            raise FileNotFoundError(
                f"checkpoint tag {tag!r} not found under {root}; tags: {known}"
            ) from None
    done = folder / DONE_MARKER
    if done.is_symlink():
        raise ContainmentError(f"{done} is a symbolic link: not a '{DONE_MARKER}' marker")
    if not is_regular(done):
        raise RuntimeError(
            f"checkpoint tag {tag!r} at {folder} is incomplete: it has no '{DONE_MARKER}' "
            f"marker (the save was interrupted or is still running)"
        )
    return folder, tag


def check_save_target(tag_dir: Path, tag: str) -> None:
    """Refuse to save into ``tag_dir`` when it is a link, or an existing folder nxd-ckpt did
    not write (it holds files nxd-ckpt never writes and neither marker nor index): saving
    there would mark someone else's files as a tag that retention may delete."""
    if not tag:
        return  # the checkpoint folder itself: the user named it; retention never deletes it
    try:
        real_dir(tag_dir, "checkpoint tag folder")
    except FileNotFoundError:
        return
    if read_marker(tag_dir) is not None or is_regular(tag_dir / INDEX_NAME):
        return
    foreign = sorted(
        entry.name
        for entry in os.scandir(tag_dir)
        if entry.name not in _NXD_FILES
        and entry.name.removesuffix(".tmp") not in _NXD_FILES
        and not (entry.name.startswith("data-") and entry.is_dir(follow_symlinks=False))
    )
    if foreign:
        raise ValueError(
            f"checkpoint tag folder {tag_dir} exists and was not written by nxd-ckpt (no "
            f"{TAG_MARKER}, no {INDEX_NAME}; it holds {foreign[:5]}): choose another tag"
        )


def begin_tag(folder: Path, tag: str) -> None:
    """Create the tag folder, its tag marker (format name and version) and start marker
    (both kept if present)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    if read_marker(folder) is None:  # informational for safety: not worth an fsync (a lost
        marker = {  # marker only means retention will never delete the tag)
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "tag": tag,
            "started_ns": now,
        }
        write_text_atomic(folder / TAG_MARKER, json.dumps(marker), durable=False)
    if not is_regular(folder / START_MARKER):
        write_text_atomic(folder / START_MARKER, str(now), durable=False)


def mark_done(folder: Path) -> None:
    """``done`` holding the completion time (ns), made durable by a folder fsync (the index
    it vouches for was made durable before)."""
    write_text_atomic(folder / DONE_MARKER, str(time.time_ns()), durable=False)
    fsync_dir(folder)


def _recognised(folder: Path) -> bool:
    """nxd-ckpt wrote ``folder``: its tag marker, or (older tags) a valid nxd-ckpt index."""
    if read_marker(folder) is not None:
        return True
    if not is_regular(folder / INDEX_NAME):
        return False
    try:
        read_index(folder)
    except (OSError, FormatError):
        return False
    return True


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_tag(folder: Path) -> None:
    """Delete a tag nxd-ckpt wrote: ``done`` first (made durable), then everything else, the
    index and markers last; links are unlinked, never followed. A link or an unrecognised
    folder is refused (ContainmentError / ValueError)."""
    real_dir(folder, "checkpoint tag folder")
    if not _recognised(folder):
        raise ValueError(
            f"{folder} carries no {TAG_MARKER} and no valid nxd-ckpt {INDEX_NAME}: not "
            f"deleted (nxd-ckpt deletes only tags it wrote)"
        )
    done = folder / DONE_MARKER
    if os.path.lexists(done):
        _unlink(done)
        fsync_dir(folder)
    last = (START_MARKER, INDEX_NAME, TAG_MARKER)
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name in last:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            _unlink(Path(entry.path))
    for name in last:
        _unlink(folder / name)
    os.rmdir(folder)


def apply_num_kept(path: Path, num_kept: int | None) -> list[str]:
    """Keep the newest ``num_kept`` complete tags nxd-ckpt wrote; also remove incomplete
    ones older than every such complete tag (left by an interrupted deletion). Newer
    incomplete tags (an interrupted save, to be redone) stay, and so does every folder
    nxd-ckpt cannot recognise. Returns the removed tag names; a tag that cannot be removed
    is a :class:`RetentionWarning` (logged too), never an error."""
    tags = [t for t in list_tags(path) if t.name and t.kind == "nxd"]
    ours = [t for t in tags if t.marked or _recognised(t.path)]
    for tag in tags:
        if tag not in ours:
            logger.info("keeping %s: not recognisable as a tag nxd-ckpt wrote", tag.path)
    complete = [t for t in ours if t.complete]
    stale = []
    if complete:
        oldest_complete = complete[0].order
        stale = [t for t in ours if not t.complete and t.order < oldest_complete]
    excess = complete[: max(0, len(complete) - num_kept)] if num_kept is not None else []
    removed = []
    for tag in [*stale, *excess]:
        logger.info("removing checkpoint tag %s (num_kept_ckpts=%s)", tag.path, num_kept)
        try:
            remove_tag(tag.path)
        except (OSError, ValueError) as error:
            retention_warning(f"could not remove old checkpoint tag {tag.path}: {error}")
            continue
        removed.append(tag.name)
    return removed


def retention_warning(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, RetentionWarning, stacklevel=2)


def remove_stale_data(folder: Path, keep: str) -> None:
    """Remove ``data-*`` folders of ``folder`` other than ``keep`` (older or failed saves);
    a link named so is unlinked, never followed."""
    for entry in os.scandir(folder):
        if not entry.name.startswith("data-") or entry.name == keep:
            continue
        if entry.is_symlink():
            _unlink(Path(entry.path))
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
    for leftover in (folder / f"{INDEX_NAME}.tmp", folder / f"{DONE_MARKER}.tmp"):
        _unlink(leftover)
