"""Containment: every path a checkpoint call touches stays inside the folder the user named.

The user names a checkpoint folder ``root`` (it may itself be a link: that is the user's
choice). Below it nothing is followed out:

* a *tag* is a plain folder name: no ``/`` or ``\\``, not ``.`` or ``..``, not absolute, no
  NUL, not hidden (leading ``.``); ``""`` names ``root`` itself (NxD's ``tag=""``);
* a path inside a tag (an index's file names) is relative, made of plain components (no
  ``..``, no ``.``, no empty component, no ``\\``, not absolute);
* **symbolic links are refused, not resolved**: a tag folder, a data folder, a data file,
  ``index.json`` or a marker that is a link is an error (:class:`ContainmentError`) and is
  never opened, listed as a tag or deleted through. Every component below ``root`` is checked
  with ``lstat`` and the file itself is opened with ``O_NOFOLLOW`` (a link swapped in after
  the check fails the open). Resolving links and requiring the target to stay inside was
  the alternative; refusing is simpler to state and to audit, and nxd-ckpt never writes a
  link, so only a damaged or hostile folder holds one.

Hugging Face folders are inputs nxd does not write (the Hugging Face cache is made of links
into its ``blobs`` folder): there the *names* an index lists must be contained paths, and
the files they name may be links (:func:`check_relative` only).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from nxd_ckpt.format._records import ContainmentError

__all__ = [
    "check_relative",
    "check_tag",
    "is_real_dir",
    "is_regular",
    "no_links_below",
    "open_regular",
    "read_small",
    "real_dir",
]

_MAX_SMALL = 1 << 16


def check_tag(tag: object, what: str = "checkpoint tag") -> str:
    """``tag`` as a plain folder name (``""``: the checkpoint folder itself), else ValueError."""
    if not isinstance(tag, str):
        raise ValueError(f"{what} must be a str, got {type(tag).__name__} {tag!r}")
    if tag == "":
        return tag
    bad = (
        "/" in tag
        or "\\" in tag
        or "\0" in tag
        or tag in (".", "..")
        or tag.startswith(".")
        or os.path.isabs(tag)
        or (os.altsep is not None and os.altsep in tag)
    )
    if bad:
        raise ValueError(
            f"{what} {tag!r} must be a plain folder name inside the checkpoint folder (no '/' "
            f"or '\\', not '.' or '..', not absolute, no leading '.')"
        )
    return tag


def check_relative(relative: object, where: str) -> PurePosixPath:
    """``relative`` as a contained relative path (plain components), else ContainmentError
    naming ``where`` (the index or folder that lists it)."""
    if not isinstance(relative, str) or not relative:
        raise ContainmentError(f"{where}: file name {relative!r} is not a non-empty string")
    path = PurePosixPath(relative)
    parts = relative.split("/")
    if (
        path.is_absolute()
        or os.path.isabs(relative)
        or "\\" in relative
        or "\0" in relative
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise ContainmentError(
            f"{where}: file name {relative!r} leaves the folder (absolute, '..', '.', an empty "
            f"component or a backslash): a checkpoint names only files inside itself"
        )
    return path


def real_dir(path: Path, what: str) -> None:
    """``path`` exists as a real folder (not a link), else an error naming it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(mode):
        raise ContainmentError(
            f"{what} {path} is a symbolic link: nxd-ckpt does not follow links inside a "
            f"checkpoint folder (name the folder it points to instead)"
        )
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(f"{what} {path} is not a folder")


def no_links_below(root: Path, relative: PurePosixPath | str) -> Path:
    """``root / relative`` after checking that no component below ``root`` is a link (the
    last one may be missing: the caller opens it with ``O_NOFOLLOW``)."""
    current = root
    parts = PurePosixPath(relative).parts
    for index, part in enumerate(parts):
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return root.joinpath(*parts)
        if stat.S_ISLNK(mode):
            raise ContainmentError(
                f"{current} is a symbolic link: nxd-ckpt does not follow links inside a "
                f"checkpoint folder"
            )
        if index < len(parts) - 1 and not stat.S_ISDIR(mode):
            raise NotADirectoryError(f"{current} is not a folder")
    return current


def open_regular(path: Path, *, follow: bool = False) -> int:
    """A read-only descriptor of the regular file ``path`` (never a link unless ``follow``,
    never a FIFO or device: those could block or read forever)."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    if not follow:  # a link is refused before any open; O_NOFOLLOW if one is swapped in
        flags |= getattr(os, "O_NOFOLLOW", 0)
        if os.path.islink(path):
            raise ContainmentError(
                f"{path} is a symbolic link: nxd-ckpt does not follow links inside a "
                f"checkpoint folder"
            )
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ContainmentError(
                f"{path} is a symbolic link: nxd-ckpt does not follow links inside a "
                f"checkpoint folder"
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ContainmentError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, limit: int = _MAX_SMALL) -> bytes | None:
    """The bytes of a small regular file (a marker), or None when it is missing, a link,
    not a regular file or larger than ``limit``."""
    try:
        fd = open_regular(path)
    except (OSError, ContainmentError):
        return None
    try:
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def is_regular(path: Path) -> bool:
    """``path`` is a regular file (a link is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_dir(path: Path) -> bool:
    """``path`` is a folder (a link is not)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
