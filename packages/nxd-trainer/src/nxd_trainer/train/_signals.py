"""Ctrl-C and SIGTERM in ``nxd-train``'s processes.

Outside the training loop both raise ``KeyboardInterrupt`` (SIGTERM too: a scheduler, or the
launcher stopping its workers), and :data:`received` records that one came, so that a worker
whose peer failed *because* the job was interrupted exits 130 quietly instead of reporting the
peer's failure. Inside the loop, :class:`~nxd_trainer.train.loop` installs its own handler
(finish the step, save) and calls :func:`mark`.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any

__all__ = ["install", "mark", "was_received"]

_received = False


def mark() -> None:
    global _received
    _received = True


def was_received() -> bool:
    """Whether this process got Ctrl-C or SIGTERM."""
    return _received


def _interrupt(signum: int, frame: Any) -> None:
    mark()
    raise KeyboardInterrupt


def install() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt and are recorded (main thread only)."""
    with contextlib.suppress(ValueError):  # not the main thread: leave the handlers alone
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupt)
