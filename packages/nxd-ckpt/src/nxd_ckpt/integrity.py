"""Check tags without loading them, and find the newest intact one (a resume's fallback).

:func:`verify_tag` checks one tag as a load would, but into no object: the tag folder is a
plain name and a real folder with ``done``; ``index.json`` is valid
(:mod:`nxd_ckpt.format._validate`: types, contained names, chunks that tile every tensor, sizes
bounded by the files, a CRC for every block); every data file is a regular file inside the tag
(no link), of the recorded size, with the recorded header CRC and a header whose entries have
each chunk's shape, dtype and a byte range inside the file; and, with ``data=True`` (default),
every chunk's bytes match their CRC-32s. A tag in NxD's own layout has no checksums: its files
are unpickled with ``torch.load(weights_only=True)`` (a damaged one fails that).

:func:`newest_intact_tag` walks the complete tags newest first and returns the first that
passes, with the newer ones that failed and why, so a resume can fall back with a warning::

    found = nxd_ckpt.newest_intact_tag("ckpts")
    for bad in found.damaged:
        logger.warning("skipping damaged checkpoint %s: %s", bad.path, bad.problem)
    if found.tag is not None:
        nxd_ckpt.load_checkpoint("ckpts", found.tag, model=model, optimizer=optimizer)

One process, no collective, nothing but the tags' own files opened; the cost is one read of
every byte of the tags it checks (``data=False``: headers and sizes only).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nxd_ckpt.format import INDEX_NAME, FormatError, _tags
from nxd_ckpt.format._contain import check_tag

__all__ = ["DamagedTag", "IntactTag", "newest_intact_tag", "verify_tag"]


@dataclass(frozen=True)
class DamagedTag:
    """A tag that failed :func:`verify_tag`."""

    tag: str
    path: Path
    problem: str
    """The error, one line (``FormatError: checkpoint file …: checksum mismatch …``)."""


@dataclass(frozen=True)
class IntactTag:
    """What :func:`newest_intact_tag` found."""

    tag: str | None
    """The newest tag that passed (None: none did, or there is none)."""
    path: Path | None
    """Its folder."""
    damaged: tuple[DamagedTag, ...]
    """The tags newer than it that failed, newest first."""


def verify_tag(path: str | os.PathLike[str], tag: str | None = None, *, data: bool = True) -> int:
    """Check tag ``tag`` under ``path`` (None: the newest complete one) without loading it
    (see the module docstring); returns the bytes of the data files checked. Raises what a
    load would: :class:`~nxd_ckpt.FormatError` (damaged or hostile index or file, naming
    it), FileNotFoundError, RuntimeError (an incomplete tag), ValueError (a bad tag name)."""
    from nxd_ckpt.load._reader import CheckpointReader

    tag_dir, _ = _tags.resolve_tag_dir(path, tag)
    if not os.path.lexists(tag_dir / INDEX_NAME):  # (a link is refused by the reader)
        return _verify_nxd_layout(tag_dir)
    with CheckpointReader(tag_dir) as reader:
        return reader.verify_files(data=data)


def _verify_nxd_layout(tag_dir: Path) -> int:
    from nxd_ckpt.format._nxd_files import is_nxd_checkpoint, scan
    from nxd_ckpt.nxd_format import torch_load_safe

    if not is_nxd_checkpoint(tag_dir):
        raise FileNotFoundError(
            f"{tag_dir} has no {INDEX_NAME} and is not in NxD's layout: not a checkpoint"
        )
    total = 0
    for sub in ("model", "optim"):
        for file in scan(tag_dir / sub).values():
            try:
                torch_load_safe(file)
            except Exception as error:  # unpickling a damaged file fails in many ways
                raise FormatError(f"checkpoint file {file} cannot be read: {error}") from error
            total += file.stat().st_size
    return total


def newest_intact_tag(
    path: str | os.PathLike[str],
    tags: Iterable[str] | None = None,
    *,
    data: bool = True,
) -> IntactTag:
    """The newest tag under ``path`` that passes :func:`verify_tag`, and the newer ones that
    failed (newest first, each with its problem). ``tags``: the candidates, oldest first
    (e.g. a job's own ``step_N`` tags in step order); default: every complete tag, ordered
    by completion time. ``data``: also check every chunk's CRC-32s (reads every byte of the
    tags checked, stopping at the first intact one). One process, no collective."""
    root = Path(path)
    if tags is None:
        names = [t.name for t in _tags.list_tags(root) if t.complete] if root.is_dir() else []
    else:
        names = [check_tag(name) for name in tags]
    damaged: list[DamagedTag] = []
    for name in reversed(names):
        folder = root / name if name else root
        try:
            verify_tag(root, name, data=data)
        except Exception as error:  # any failure of a check means: not this tag
            problem = f"{type(error).__name__}: {error}".replace("\n", " ")
            damaged.append(DamagedTag(name, folder, problem))
            continue
        return IntactTag(name, folder, tuple(damaged))
    return IntactTag(None, None, tuple(damaged))
