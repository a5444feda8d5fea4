"""Refuse ``pytorch_lightning`` objects in a ``lightning`` job, naming each one.

``lightning`` (``lightning.pytorch``) and ``pytorch_lightning`` ship the same classes twice, as
unrelated types: a ``pytorch_lightning.callbacks.ModelCheckpoint`` handed to a
``lightning.pytorch.Trainer`` is not a ``ModelCheckpoint`` to it (Lightning then adds its own
and fails on the duplicate state key, or calls the foreign object's hooks with a trainer of the
other package). NxD's documentation imports from ``pytorch_lightning``, so a ported script
mixes them easily. nxd-lightning is built on ``lightning.pytorch`` only.

Two checks: when the Trainer is being constructed (its ``callbacks``, ``logger`` and
``plugins`` arguments, read from the constructor's frame: Lightning validates callbacks right
after it builds the strategy, and its own errors are obscure), and when a run starts (the
trainer's callbacks, loggers, module and datamodule: the check that does not depend on how the
Trainer was called).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

__all__ = ["check_no_pytorch_lightning", "from_pytorch_lightning", "trainer_init_arguments"]

_FOREIGN = "pytorch_lightning"


def from_pytorch_lightning(obj: object) -> bool:
    """Whether ``obj``'s class (or a base of it) comes from the ``pytorch_lightning`` package."""
    return any(
        (getattr(cls, "__module__", "") or "").split(".")[0] == _FOREIGN
        for cls in type(obj).__mro__
    )


def _flatten(value: Any) -> Iterable[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return value
    return [value]


def check_no_pytorch_lightning(objects: dict[str, Any]) -> None:
    """Raise TypeError naming every ``pytorch_lightning`` object in ``objects`` (name -> value
    or list of values)."""
    bad = [
        f"{name}: {type(obj).__module__}.{type(obj).__qualname__}"
        for name, value in objects.items()
        for obj in _flatten(value)
        if from_pytorch_lightning(obj)
    ]
    if bad:
        raise TypeError(
            "pytorch_lightning objects were passed to a lightning.pytorch Trainer: "
            + "; ".join(bad)
            + ". The two packages define separate classes that do not work together; "
            "nxd_lightning uses `lightning.pytorch`: import the same classes from there "
            "(e.g. `from lightning.pytorch.callbacks import ModelCheckpoint`, "
            "`from lightning.pytorch import LightningDataModule`)"
        )


def trainer_init_arguments(max_depth: int = 16) -> dict[str, Any] | None:
    """The ``callbacks``, ``logger`` and ``plugins`` arguments of the ``lightning.pytorch.Trainer``
    whose constructor is on the call stack, or None if none is (within ``max_depth`` frames)."""
    from lightning.pytorch import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(max_depth):
            if frame is None:
                return None
            if frame.f_code.co_name == "__init__" and isinstance(
                frame.f_locals.get("self"), Trainer
            ):
                local = frame.f_locals
                return {key: local.get(key) for key in ("callbacks", "logger", "plugins")}
            frame = frame.f_back
        return None
    finally:
        del frame
