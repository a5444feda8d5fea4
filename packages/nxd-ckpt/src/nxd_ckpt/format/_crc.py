"""CRC-32s of a tensor's row blocks, computed on a thread while the writer writes.

The checksum is zlib's CRC-32 (IEEE 802.3 polynomial, reflected). ``crc32`` is ISA-L's
(``isal.isal_zlib.crc32``: the same values, folded with carry-less multiplies, several times
faster than zlib 1.2's table-driven loop, which ran at ~1 GB/s, no faster than a fast disk)
when ``isal`` imports, else ``zlib.crc32``. Both release the GIL, as ``os.write`` does, so
checksumming tensor i on this thread while the writer writes the next ones costs little wall
time. A plain daemon thread, not a ``concurrent.futures`` pool: pools refuse work once
interpreter shutdown starts, which is when an async save may still be finishing; a forked
child starts its own thread.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections.abc import Callable

crc32: Callable[..., int]
"""``crc32(data, value=0)``: zlib's CRC-32 of a bytes-like object, continuing ``value``."""
try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    crc32 = zlib.crc32

__all__ = ["Pending", "block_crcs", "crc32", "crc_thread"]


def block_crcs(data: memoryview, block: int, scalar: bool) -> list[int]:
    """CRC-32 of each ``block`` bytes of ``data`` (one CRC for a 0-d tensor)."""
    crcs = [crc32(data[start : start + block]) for start in range(0, len(data), max(block, 1))]
    return crcs or [crc32(b"")] if scalar else crcs


class Pending:
    """The CRCs of one tensor, computed by the CRC thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.crcs: list[int] = []
        self.error: BaseException | None = None

    def result(self) -> list[int]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.crcs


class _CrcThread:
    """One daemon thread computing CRCs while the caller writes (both release the GIL). Not
    a concurrent.futures pool: those refuse work once interpreter shutdown starts, which is
    when an async save may still be finishing."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Pending, memoryview, int, bool]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="nxd-ckpt-crc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            pending, data, block, scalar = self._queue.get()
            try:
                pending.crcs = block_crcs(data, block, scalar)
            except BaseException as error:  # handed to the writer
                pending.error = error
            pending.done.set()

    def submit(self, data: memoryview, block: int, scalar: bool) -> Pending:
        pending = Pending()
        self._queue.put((pending, data, block, scalar))
        return pending


_CRC: _CrcThread | None = None
_CRC_LOCK = threading.Lock()


def _forget_crc_thread() -> None:
    """A forked child has no copy of the parent's threads: start its own when needed."""
    global _CRC, _CRC_LOCK
    _CRC, _CRC_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_crc_thread)


def crc_thread() -> _CrcThread:
    global _CRC
    with _CRC_LOCK:
        if _CRC is None:
            _CRC = _CrcThread()
        return _CRC
