"""At most ``num_workers`` processes of a host read or write checkpoint files at once.

A slot is an exclusive ``flock`` on one of ``num_workers`` lock files in the host's temp
folder; the kernel releases it when the holder exits, even by SIGKILL, so a killed writer
never blocks the others. Where ``fcntl`` is missing the bound is not enforced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

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
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    folder = _slot_dir()
    handles = [open(folder / f"slot-{i}.lock", "a+") for i in range(num_workers)]  # noqa: SIM115
    held = None
    try:
        started = time.monotonic()
        while held is None:
            for offset in range(num_workers):
                handle = handles[(local_rank + offset) % num_workers]
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                held = handle
                break
            else:
                time.sleep(0.005)
        waited = time.monotonic() - started
        if waited > 1.0:
            logger.info("%s waited %.1fs for one of %d host slots", what, waited, num_workers)
        yield
    finally:
        if held is not None:
            fcntl.flock(held.fileno(), fcntl.LOCK_UN)
        for handle in handles:
            handle.close()
