"""The next optimizer step waits while an async save still copies parameters and optimizer state.

``save_checkpoint(async_save=True, async_copy="before_step")`` returns before copying the
tensors that only optimizer steps change in place (parameters, optimizer state); its
background thread copies them first. Until it has, the gate is closed: a global
``torch.optim`` step pre-hook (registered once, a no-op while the gate is open) makes any
optimizer's ``step`` wait. Every nxd optimizer changes parameters, masters and state inside
some ``torch.optim.Optimizer.step`` (NxDOptimizer's inner optimizer, ZeRO-1's own step and
its inner one), so the copy is a snapshot of the state at save time. Changes made otherwise
are caught by the tensors' version counters (the save then fails with the tensor's name).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

__all__ = ["close", "is_open", "open_gate", "waited_s"]

logger = logging.getLogger(__name__)

_OPEN = threading.Event()
_OPEN.set()
_HOOK: Any = None
_HOOK_LOCK = threading.Lock()
_WAITED = [0.0]  # seconds optimizer steps of this process spent waiting, in total


def _wait_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _OPEN.is_set():
        return
    started = time.perf_counter()
    _OPEN.wait()
    waited = time.perf_counter() - started
    _WAITED[0] += waited
    logger.info(
        "%s.step waited %.3fs for an async checkpoint's copy", type(optimizer).__name__, waited
    )


def close() -> None:
    """Make optimizer steps wait until :func:`open_gate` (the hook is registered once)."""
    global _HOOK
    with _HOOK_LOCK:
        if _HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOK = register_optimizer_step_pre_hook(_wait_before_step)
    _OPEN.clear()


def open_gate() -> None:
    _OPEN.set()


def is_open() -> bool:
    return _OPEN.is_set()


def waited_s() -> float:
    """Seconds this process's optimizer steps have waited at the gate, in total."""
    return _WAITED[0]


def _reset_after_fork() -> None:
    """A forked child has no copying thread: its steps must not wait."""
    global _OPEN
    _OPEN = threading.Event()
    _OPEN.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
