"""NxD's own tag layout, recognised without reading it: ``model/`` and ``optim/`` rank files.

NxD writes ``<tag>/model/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt`` (and ``optim/`` likewise). A
tag folder holding such files is a checkpoint (listed, loadable, never deleted by retention)
even without nxd-ckpt's marker or index; reading the files is :mod:`nxd_ckpt.nxd_format`'s.
Links are never followed: a linked folder or rank file is refused (``strict``) or not counted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from nxd_ckpt.format._records import ContainmentError

__all__ = ["is_nxd_checkpoint", "refuse_link", "scan"]

_FILE = re.compile(r"^dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")


def refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise ContainmentError(
            f"{path} is a symbolic link: nxd-ckpt does not follow links inside a checkpoint folder"
        )


def scan(folder: Path, *, strict: bool = True) -> dict[tuple[int, int, int], Path]:
    """(dp, tp, pp) -> file of one of NxD's ``model`` / ``optim`` folders; a link (the
    folder or a file) is refused with ``strict``, else ignored."""
    found: dict[tuple[int, int, int], Path] = {}
    if folder.is_symlink():
        if strict:
            refuse_link(folder)
        return found
    if not folder.is_dir():
        return found
    for path in folder.iterdir():
        if path.is_symlink():
            if strict and _FILE.match(path.name):
                refuse_link(path)
            continue
        if "_ep_rank_" in path.name:
            raise NotImplementedError(
                f"{path}: expert-parallel NxD checkpoints are not supported (nxd has no EP)"
            )
        match = _FILE.match(path.name)
        if match:
            dp, tp, pp = (int(g) for g in match.groups())
            found[(dp, tp, pp)] = path
    return found


def is_nxd_checkpoint(tag_dir: str | os.PathLike[str]) -> bool:
    """Whether ``tag_dir`` holds NxD's layout (``model/`` or ``optim/`` rank files; links
    are not counted)."""
    try:
        return any(scan(Path(tag_dir) / sub, strict=False) for sub in ("model", "optim"))
    except NotImplementedError:  # expert-parallel files: NxD's, refused when loaded
        return True
