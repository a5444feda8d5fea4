"""Reading safetensors files without trusting them: header checked, rows read by ``pread``.

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the
data area. :class:`SafetensorsFile` opens the file once (``O_NOFOLLOW`` unless told to follow
links, regular files only), checks its size and header CRC against the index record when
there is one, and parses the header itself: every entry needs a known dtype, a shape of
non-negative integers and a byte range inside the data area of exactly
``numel * itemsize`` bytes. Any problem is a :class:`~nxd_ckpt.format.FormatError` naming
the file and the key, never a library exception without the file's name. Rows are read
with ``pread`` from the descriptor opened at the check, so a file renamed over it later is
not read.

:class:`FileReader` reads boxes of the chunks an index stores in one file: the entry must
have the chunk's shape and the tensor's dtype (a stored tensor of another shape is never
broadcast into a model), and the CRC-32 of every block of rows a read touches is verified
(a partial read widens to whole blocks).
"""

from __future__ import annotations

import json
import math
import os
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import torch

from nxd_ckpt.format._boxes import Box
from nxd_ckpt.format._contain import open_regular
from nxd_ckpt.format._crc import crc32
from nxd_ckpt.format._records import ChunkRecord, FileRecord, FormatError
from nxd_ckpt.format._stfile import _ST_DTYPES, dtype_name

__all__ = ["Entry", "FileReader", "SafetensorsFile"]

_FROM_CODE = {code: dtype for dtype, code in _ST_DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20
"""Largest header accepted (safetensors' own limit)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype, shape and absolute byte range."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else 0


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise FormatError(
                f"checkpoint file {path} ended at byte {offset + done} while reading "
                f"{len(view)} bytes at {offset}: truncated or changed while reading"
            )
        done += count


class SafetensorsFile:
    """An open, header-checked safetensors file (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        follow: bool = False,
        size: int | None = None,
        header_crc32: int | None = None,
    ) -> None:
        """``size`` / ``header_crc32``: what the index recorded (None: not recorded, as for
        a Hugging Face file). ``follow``: open a link (Hugging Face folders only)."""
        self.path = path
        try:
            fd = open_regular(path, follow=follow)
        except FileNotFoundError:
            raise FormatError(f"checkpoint file {path} is missing (the index lists it)") from None
        except OSError as error:
            raise FormatError(f"checkpoint file {path} cannot be opened: {error}") from error
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            raise FormatError(
                f"checkpoint file {path} has {actual} bytes, the index says {size}: "
                f"truncated or overwritten"
            )
        head = os.pread(fd, 8, 0)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 <= length <= min(actual - 8, MAX_HEADER_BYTES):
            raise FormatError(
                f"checkpoint file {path}: header length {length} does not fit the file's "
                f"{actual} bytes: not a safetensors file, or damaged"
            )
        body = os.pread(fd, length, 8) if length else b""
        if header_crc32 is not None and crc32(head + body) != header_crc32:
            raise FormatError(f"checkpoint file {path}: header checksum mismatch (corrupted)")
        self.data_start = 8 + length
        self.entries = self._parse(body, actual - self.data_start)

    def _parse(self, body: bytes, data_size: int) -> dict[str, Entry]:
        try:
            header = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            raise FormatError(f"checkpoint file {self.path}: header is not JSON: {error}") from None
        if not isinstance(header, dict):
            raise FormatError(f"checkpoint file {self.path}: header is not a JSON object")
        entries = {}
        for key, value in header.items():
            if key == "__metadata__":
                continue
            where = f"checkpoint file {self.path}: tensor {key!r}"
            if not isinstance(value, dict):
                raise FormatError(f"{where}: header entry is not an object")
            dtype = _FROM_CODE.get(value.get("dtype"))  # type: ignore[arg-type]
            if dtype is None:
                raise FormatError(f"{where}: unknown dtype {value.get('dtype')!r}")
            shape, offsets = value.get("shape"), value.get("data_offsets")
            if not _is_ints(shape) or not _is_ints(offsets) or len(offsets) != 2:
                raise FormatError(f"{where}: shape {shape!r} / data_offsets {offsets!r} invalid")
            begin, end = offsets
            if not begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
                raise FormatError(
                    f"{where}: data_offsets {offsets} do not hold {math.prod(shape)} "
                    f"{dtype_name(dtype)} elements inside the {data_size}-byte data area"
                )
            start = self.data_start + begin
            entries[key] = Entry(key, dtype, tuple(shape), start, self.data_start + end)
        return entries

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise FormatError(f"checkpoint file {self.path} holds no tensor {key!r}") from None

    def rows(self, entry: Entry, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``entry`` (the whole tensor when 0-d)."""
        shape: tuple[int, ...]
        if not entry.shape:
            offset, nbytes, shape = entry.begin, entry.end - entry.begin, ()
        else:
            offset = entry.begin + start * entry.row_bytes
            nbytes = (stop - start) * entry.row_bytes
            shape = (stop - start, *entry.shape[1:])
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            # numpy's stubs give ndarray its buffer protocol (__buffer__) only for Python 3.12+.
            view = memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]
            _pread_into(self.fd, view, offset, self.path)
        return buffer.view(entry.dtype).reshape(shape)

    def tensor(self, key: str) -> torch.Tensor:
        entry = self.entry(key)
        return self.rows(entry, 0, entry.shape[0] if entry.shape else 0)

    def close(self) -> None:
        self._closer()


def _is_ints(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _crc_of(tensor: torch.Tensor) -> int:
    from nxd_ckpt.format._stfile import as_bytes

    return crc32(as_bytes(tensor.contiguous()))


class FileReader:
    """Reads boxes of the chunks stored in one data file, verifying sizes and CRCs."""

    def __init__(
        self,
        path: Path,
        record: FileRecord | None,
        *,
        verify: bool = True,
        follow: bool = False,
    ) -> None:
        """``record`` None: a foreign safetensors file (Hugging Face), no CRCs to verify.
        ``path`` must have been checked by the caller (:mod:`nxd_ckpt.format._contain`)."""
        self.path = path
        self.verify = verify and record is not None
        self.file = SafetensorsFile(
            path,
            follow=follow,
            size=None if record is None else record.size,
            header_crc32=None if record is None else record.header_crc32,
        )

    def entry(self, chunk: ChunkRecord, dtype: str | None = None) -> Entry:
        """The header entry of ``chunk``, checked against it: the stored shape is the
        chunk's (or holds its box, for foreign layouts) and the dtype the index's."""
        entry = self.file.entry(chunk.key)
        where = f"checkpoint file {self.path}: tensor {chunk.key!r}"
        if dtype is not None and dtype_name(entry.dtype) != dtype:
            raise FormatError(
                f"{where} is stored as {dtype_name(entry.dtype)}, the index says {dtype}"
            )
        if chunk.stored_offsets is None:
            if list(entry.shape) != list(chunk.shape):
                raise FormatError(
                    f"{where} has shape {list(entry.shape)}, the index says {chunk.shape}"
                )
        else:
            inner = Box(tuple(chunk.stored_offsets), tuple(chunk.shape))
            if len(entry.shape) != inner.ndim or not Box.whole(entry.shape).contains(inner):
                raise FormatError(f"{where} of shape {list(entry.shape)} does not hold {inner}")
        return entry

    def read(self, chunk: ChunkRecord, box: Box, dtype: str | None = None) -> torch.Tensor:
        """``box`` (in the chunk's own coordinates) of the stored chunk."""
        entry = self.entry(chunk, dtype)
        if chunk.stored_offsets is not None:  # a box inside a bigger stored tensor
            inner = box.shifted(tuple(chunk.stored_offsets))
            return self._plain(entry, inner)
        if not self.verify:
            return self._plain(entry, box)
        if not chunk.shape:
            value = self.file.rows(entry, 0, 0)
            if [_crc_of(value)] != chunk.crc32:
                raise self._corrupt(chunk, 0)
            return value
        rows = chunk.crc_rows
        first, last = box.offsets[0] // rows, -(-(box.offsets[0] + box.shape[0]) // rows)
        start, stop = first * rows, min(last * rows, chunk.shape[0])
        data = self.file.rows(entry, start, stop)
        for index, block in enumerate(range(first, last)):
            piece = data[index * rows : (index + 1) * rows]
            if block >= len(chunk.crc32) or _crc_of(piece) != chunk.crc32[block]:
                raise self._corrupt(chunk, block)
        rows_wanted = slice(box.offsets[0] - start, box.offsets[0] - start + box.shape[0])
        return data[(rows_wanted, *box.slices()[1:])]

    def _plain(self, entry: Entry, box: Box) -> torch.Tensor:
        if not entry.shape:
            return self.file.rows(entry, 0, 0)
        start, stop = box.offsets[0], box.offsets[0] + box.shape[0]
        data = self.file.rows(entry, start, stop)
        return data[(slice(None), *box.slices()[1:])]

    def _corrupt(self, chunk: ChunkRecord, block: int) -> FormatError:
        return FormatError(
            f"checkpoint file {self.path}: checksum mismatch in tensor {chunk.key!r} (rows "
            f"{block * chunk.crc_rows}..{(block + 1) * chunk.crc_rows - 1}): the file is corrupted"
        )

    def verify_all(self, chunks: Sequence[tuple[ChunkRecord, str]]) -> None:
        """Read and check every ``(chunk, dtype)`` stored here."""
        for chunk, dtype in chunks:
            self.read(chunk, Box.whole(chunk.shape), dtype)

    def close(self) -> None:
        self.file.close()
