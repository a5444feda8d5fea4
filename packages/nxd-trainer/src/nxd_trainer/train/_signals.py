"""Ctrl-C and SIGTERM in ``nxd-train``'s processes.

Outside the training loop both raise ``KeyboardInterrupt`` (SIGTERM too: a scheduler, or the
launcher stopping its workers), and :data:`received` records that one came, so that a worker
whose peer failed *because* the job was interrupted exits 130 quietly instead of reporting the
peer's failure. Inside the loop, :class:`~nxd_trainer.train.loop` installs its own handler
(finish the step, save) and calls :func:`mark`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher", "install", "mark", "was_received"]

# Set by the nxd-train launcher for its workers: its process id.
LAUNCHER_PID_ENV = "NXD_TRAIN_LAUNCHER_PID"

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


def die_with_launcher() -> None:
    """A worker of the nxd-train launcher gets SIGTERM when the launcher dies (killed, lost):
    it finishes its step, saves and exits like on Ctrl-C, never left running re-parented.

    Linux: the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon
    thread that watches the parent process id. A launcher already gone is seen at once.
    """
    value = os.environ.get(LAUNCHER_PID_ENV)
    if value is None:
        return
    launcher = int(value)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    else:
        threading.Thread(target=_watch_parent, args=(launcher,), daemon=True).start()
    if os.getppid() != launcher:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
