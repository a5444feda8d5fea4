"""At most ``num_workers`` processes of a host read or write checkpoint files at once.

A slot is an exclusive lock (``filelock``: ``flock`` on POSIX, ``msvcrt`` locking on Windows)
on one of ``num_workers`` lock files in the host's temp folder; the operating system releases
it when the holder exits, even by SIGKILL, so a killed writer never blocks the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

__all__ = ["host_slot"]

logger = logging.getLogger(__name__)


def _slot_dir() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(tempfile.gettempdir()) / f"nxd-ckpt-slots-{uid}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def host_slot(num_workers: int, local_rank: int, what: str) -> Iterator[None]:
    """Hold one of ``num_workers`` host-wide slots for the duration of the block."""
    folder = _slot_dir()
    locks = [FileLock(folder / f"slot-{i}.lock") for i in range(num_workers)]
    held = None
    try:
        started = time.monotonic()
        while held is None:
            for offset in range(num_workers):
                lock = locks[(local_rank + offset) % num_workers]
                try:
                    lock.acquire(timeout=0)  # one attempt
                except Timeout:
                    continue
                held = lock
                break
            else:
                time.sleep(0.005)
        waited = time.monotonic() - started
        if waited > 1.0:
            logger.info("%s waited %.1fs for one of %d host slots", what, waited, num_workers)
        yield
    finally:
        if held is not None:
            held.release()
