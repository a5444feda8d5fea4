"""Undo for the one object a load changes before the model: the scheduler.

A load applies the scheduler's state first (it is small, and a scheduler of another type
than the saved one may reject it only inside its own ``load_state_dict``); if that or
anything after it fails, the scheduler's attributes are put back as they were, so a failed
load leaves the scheduler exactly as before. The snapshot deep-copies the scheduler's
attributes except its optimizer (and what only the optimizer references), which stay shared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from nxd_ckpt.format import FormatError
from nxd_state.shards import json_checkpoint_state

__all__ = ["apply_scheduler", "snapshot"]


def snapshot(scheduler: Any) -> Callable[[], None]:
    """A call that puts ``scheduler``'s attributes back as they are now (its optimizer and
    what it references are shared, not copied)."""
    attributes = getattr(scheduler, "__dict__", None)
    if attributes is None:
        return lambda: None
    optimizer = attributes.get("optimizer")
    memo: dict[int, Any] = {} if optimizer is None else {id(optimizer): optimizer}
    saved = {}
    for key, value in attributes.items():
        try:
            saved[key] = copy.deepcopy(value, memo)
        except Exception:  # an attribute that cannot be copied is kept as it is
            saved[key] = value

    def restore() -> None:
        attributes.clear()
        attributes.update(saved)

    return restore


def apply_scheduler(scheduler: Any, state: Any, where: str) -> Callable[[], None]:
    """Load ``state`` into ``scheduler`` (:func:`nxd_state.shards.json_checkpoint_state`: its
    ``load_checkpoint_json``, or torch's ``load_state_dict``); returns the call that undoes
    it. A scheduler that rejects the state (another type, saved before types were recorded)
    is put back as it was and the error names the tag and the scheduler."""
    if scheduler is None:
        return lambda: None
    target = json_checkpoint_state(scheduler)  # (TypeError: a scheduler without state)
    restore = snapshot(scheduler)
    try:
        target.load_checkpoint_json(state)
    except Exception as error:
        restore()
        raise FormatError(
            f"{where}: loading its scheduler state into this {type(scheduler).__name__} "
            f"failed ({type(error).__name__}: {error}); was it saved from another scheduler "
            f"type? Nothing was loaded"
        ) from error
    return restore
