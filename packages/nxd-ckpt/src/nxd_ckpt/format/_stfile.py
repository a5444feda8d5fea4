"""Safetensors files written tensor by tensor, with CRC-32s, and read back box by box.

Layout (the safetensors format): an 8-byte little-endian header length n, n bytes of JSON
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, padded
with spaces to a multiple of 8), then the tensors' bytes back to back. Tensors are ordered by
element size, largest first, so every tensor starts aligned to its element size.

Writing streams each tensor's bytes to a temporary file in blocks (no serialised copy of the
whole file), computes the CRC-32 of every block of rows on the way, fsyncs, renames to the
final name and fsyncs the folder. Temporary files are created with ``O_EXCL | O_NOFOLLOW``
after removing any leftover, so a link planted under a temporary name is never written
through. Reading is :mod:`nxd_ckpt.format._stread`'s.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from nxd_ckpt.format._crc import Pending, crc32, crc_thread
from nxd_ckpt.format._records import FormatError

__all__ = [
    "CRC_BLOCK_BYTES",
    "FileDigest",
    "FilePlan",
    "dtype_from_name",
    "dtype_name",
    "fsync_dir",
    "plan_file",
    "write_planned",
]

CRC_BLOCK_BYTES = 4 << 20
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"unknown dtype {name!r} in checkpoint index")
    return dtype


def _st_dtype(dtype: torch.dtype) -> str:
    try:
        return _ST_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be stored in safetensors; supported: "
            f"{sorted(dtype_name(d) for d in _ST_DTYPES)}"
        ) from None


def crc_rows_for(shape: Sequence[int], itemsize: int) -> int:
    """Rows (dim 0) per CRC block: as many as fit in ``CRC_BLOCK_BYTES``, at least one."""
    if not shape:
        return 1
    row_bytes = max(1, math.prod(shape[1:]) * itemsize)
    return max(1, CRC_BLOCK_BYTES // row_bytes)


@dataclass(frozen=True)
class PlannedEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def crc_rows(self) -> int:
        return crc_rows_for(self.shape, self.dtype.itemsize)


@dataclass(frozen=True)
class FilePlan:
    """Header bytes and where each tensor's bytes go, before any data is written."""

    header: bytes
    entries: tuple[PlannedEntry, ...]
    data_size: int

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size


@dataclass(frozen=True)
class FileDigest:
    """What was written: the file's record and each key's block CRCs."""

    size: int
    crc32: int
    header_crc32: int
    block_crcs: dict[str, list[int]]


def plan_file(
    items: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> FilePlan:
    """Lay out ``(key, dtype, shape)`` items: largest element size first, then given order."""
    ordered = sorted(items, key=lambda item: -item[1].itemsize)
    entries, header, offset = [], {}, 0
    for key, dtype, shape in ordered:
        nbytes = math.prod(shape) * dtype.itemsize
        entries.append(PlannedEntry(key, dtype, tuple(shape), offset, offset + nbytes))
        header[key] = {
            "dtype": _st_dtype(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return FilePlan(struct.pack("<Q", len(text)) + text, tuple(entries), offset)


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        raise ValueError("as_bytes needs a contiguous CPU tensor")
    # numpy's stubs give ndarray its buffer protocol (__buffer__) only for Python 3.12+.
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_planned(
    path: Path, plan: FilePlan, tensors: Sequence[torch.Tensor | Callable[[], torch.Tensor]]
) -> FileDigest:
    """Write ``tensors`` (contiguous, CPU, in ``plan.entries`` order; or callables returning
    them, called one at a time so at most two such copies are alive) as the file ``path``.

    The CRC thread checksums each tensor while the next ones are written and while the file
    is fsynced (the disk is the slower of the two: the CRCs cost little wall time).
    Atomic: written under ``<path>.tmp``, fsynced, renamed, folder fsynced. On any error the
    temporary file is removed and an OSError naming ``path`` is raised.
    """
    if len(tensors) != len(plan.entries):
        raise ValueError(f"{path}: plan has {len(plan.entries)} tensors, got {len(tensors)}")
    tmp = path.with_name(path.name + ".tmp")
    block_crcs: dict[str, list[int]] = {}
    file_crc = header_crc = crc32(plan.header)
    pending: list[tuple[str, Pending, bool]] = []  # (key, CRCs, a copy made for writing)
    try:
        fd = _create(tmp)
        try:
            _write_all(fd, memoryview(plan.header))
            for entry, source in zip(plan.entries, tensors):
                if callable(source):  # a copy: the previous copies' CRCs first (memory bound)
                    for key, crcs, copied in pending:
                        if copied:
                            block_crcs[key] = crcs.result()
                data = as_bytes(source() if callable(source) else source)
                if len(data) != entry.end - entry.begin:
                    raise ValueError(
                        f"{path}: tensor {entry.key} has {len(data)} bytes, planned "
                        f"{entry.end - entry.begin}"
                    )
                rows = entry.shape[0] if entry.shape else 1
                block = entry.crc_rows * (len(data) // rows if rows else 0)
                crcs = crc_thread().submit(data, block, not entry.shape)
                pending.append((entry.key, crcs, callable(source)))
                _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        for key, crcs, _ in pending:
            block_crcs[key] = crcs.result()
            for crc in block_crcs[key]:
                file_crc = crc32(struct.pack("<I", crc), file_crc)
        os.replace(tmp, path)
    except OSError as error:
        _remove_quietly(tmp)
        code = error.errno if error.errno is not None else errno.EIO
        raise OSError(
            code, f"writing checkpoint file {path} failed: {error.strerror or error}"
        ) from error
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_dir(path.parent)
    return FileDigest(plan.size, file_crc, header_crc, block_crcs)


def _create(tmp: Path) -> int:
    """A new file ``tmp`` for writing: a leftover (or a planted link) is removed first, and
    ``O_EXCL | O_NOFOLLOW`` refuse anything that appears there meanwhile."""
    _remove_quietly(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return os.open(tmp, flags | getattr(os, "O_CLOEXEC", 0), 0o644)


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """Write a small text file atomically (tmp, rename): readers see all of it or nothing.
    ``durable``: also fsync the file before and its folder after the rename."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = _create(tmp)
        try:
            _write_all(fd, memoryview(text.encode()))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as error:
        _remove_quietly(tmp)
        code = error.errno if error.errno is not None else errno.EIO
        raise OSError(code, f"writing {path} failed: {error.strerror or error}") from error
    if durable:
        fsync_dir(path.parent)
