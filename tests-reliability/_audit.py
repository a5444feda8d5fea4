"""Which paths a call opens, lists or deletes: Python's audit hooks, checked against a folder.

``with audit_paths(root) as audit: ...`` records every ``open`` (``open()``, ``os.open``,
``io.open_code``, ``torch.load``'s file opening), directory listing (``os.scandir``,
``os.listdir``) and deletion or rename (``os.remove`` / ``os.unlink``, ``os.rmdir``,
``os.rename`` / ``os.replace``, ``shutil.rmtree``) made by any thread of this process while the
block runs; :meth:`PathAudit.outside` lists those whose path is not inside ``root`` or one of
the allowed places. An opened or listed path is resolved (``os.path.realpath``: a link is
judged by where it points); a deleted or renamed path is judged by its folder, resolved, and
its own name (unlinking a link touches the link, not its target).

Allowed besides ``root``: the Python installation and every ``sys.path`` folder (modules
imported lazily during the call), ``/proc``, ``/sys``, ``/dev`` and nxd-ckpt's host-slot lock
folder. Calls relative to a directory descriptor (``shutil.rmtree``'s inner steps) are judged
by the ``shutil.rmtree`` event of their tree. Native code that opens files without Python's
``open`` (safetensors' Rust reader, used only for Hugging Face folders by nxd-trainer) is not
seen; nxd-ckpt's own reads all go through ``os.open``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["PathAudit", "audit_paths"]

_READ = {"open", "os.scandir", "os.listdir"}
_WRITE = {"os.remove", "os.rmdir", "os.rename", "shutil.rmtree", "os.mkdir", "os.truncate"}
_ACTIVE: list[PathAudit] = []
_INSTALLED = False


def _as_path(value: object) -> str | None:
    if isinstance(value, bytes):
        return os.fsdecode(value)
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    return None  # a descriptor


def _hook(event: str, args: tuple) -> None:
    if not _ACTIVE or (event not in _READ and event not in _WRITE):
        return
    if event == "os.rename":  # (src, dst, src_dir_fd, dst_dir_fd)
        pairs = [(args[0], args[2]), (args[1], args[3])]
    elif event in ("os.remove", "os.rmdir", "os.mkdir"):  # (path, [mode,] dir_fd)
        pairs = [(args[0], args[-1])]
    else:
        pairs = [(args[0], None)]
    for value, dir_fd in pairs:
        path = _as_path(value)
        if path is None or dir_fd is not None:
            continue
        for audit in _ACTIVE:
            audit.events.append((event, path))


def _install() -> None:
    global _INSTALLED
    if not _INSTALLED:
        sys.addaudithook(_hook)  # hooks cannot be removed: one for the process, idle when off
        _INSTALLED = True


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@dataclass
class PathAudit:
    """The recorded ``(event, path)`` pairs of one ``audit_paths`` block."""

    roots: list[str]
    events: list[tuple[str, str]] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)

    def judged(self, event: str, path: str) -> str:
        if event in _READ:
            return os.path.realpath(path)
        folder, name = os.path.split(os.path.abspath(path))
        return os.path.join(os.path.realpath(folder), name)

    def outside(self) -> list[tuple[str, str]]:
        """Events whose (judged) path is outside the roots and the allowed places."""
        bad = []
        for event, path in self.events:
            where = self.judged(event, path)
            if any(_inside(where, root) for root in self.roots):
                continue
            if any(_inside(where, place) for place in self.allowed):
                continue
            bad.append((event, where))
        return bad

    def touched(self, folder: str | os.PathLike[str]) -> list[tuple[str, str]]:
        """Events whose judged path lies inside ``folder``."""
        target = os.path.realpath(folder)
        return [(e, p) for e, p in self.events if _inside(self.judged(e, p), target)]


def _allowed_places() -> list[str]:
    places = {sys.prefix, sys.base_prefix, sys.exec_prefix, "/proc", "/sys", "/dev"}
    places.update(p for p in sys.path if p and os.path.isdir(p))
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    places.add(os.path.join(tempfile.gettempdir(), f"nxd-ckpt-slots-{uid}"))
    return sorted(os.path.realpath(p) for p in places)


@contextmanager
def audit_paths(*roots: str | os.PathLike[str]) -> Iterator[PathAudit]:
    """Record the paths the block touches (see the module docstring)."""
    _install()
    audit = PathAudit([os.path.realpath(r) for r in roots], allowed=_allowed_places())
    _ACTIVE.append(audit)
    try:
        yield audit
    finally:
        _ACTIVE.remove(audit)
