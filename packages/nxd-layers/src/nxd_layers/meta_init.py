"""Building a model whose parameters have no storage yet: NxD's ``init_on_device``.

Inside ``init_on_device(device)`` every parameter a module registers is put on ``device``; with
``torch.device("meta")`` that gives each one a shape and a dtype and no memory, and a
``param_init_fn`` fills it later (after sharding or pipeline partitioning kept only this rank's
part). Buffers (rotary tables, masks ...) are computed as usual unless ``include_buffers``,
in which case every tensor created inside lands on ``device`` (torch's device context), so they
are meta too and whoever materialises the model must recompute them.

The parallel layers read :func:`parameters_on_meta`: while parameters go to ``meta`` they draw
no full master weight (nothing to slice it into), exactly as when built with ``device="meta"``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["init_on_device", "parameters_on_meta"]

_STATE = threading.local()


def parameters_on_meta() -> bool:
    """Whether parameters registered now go to the meta device (an ``init_on_device(meta)``
    block is open in this thread)."""
    return getattr(_STATE, "meta_depth", 0) > 0


@contextlib.contextmanager
def _counting_meta(device: torch.device) -> Iterator[None]:
    meta = device.type == "meta"
    _STATE.meta_depth = getattr(_STATE, "meta_depth", 0) + int(meta)
    try:
        yield
    finally:
        _STATE.meta_depth -= int(meta)


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Parameters registered inside go to ``device`` (a new ``nn.Parameter`` of the same class,
    ``requires_grad`` and attributes such as ``tensor_model_parallel`` kept); with
    ``include_buffers`` every tensor created inside defaults to ``device`` as well.

    Not re-entrant across threads' module registration: it patches
    ``nn.Module.register_parameter`` for the duration of the block, as NxD's does.
    """
    if not isinstance(include_buffers, bool):
        raise TypeError(f"include_buffers must be a bool, got {include_buffers!r}")
    target = torch.device(device)
    if include_buffers:
        with _counting_meta(target), target:
            yield
        return
    register = nn.Module.register_parameter

    # ``self``: it replaces the method nn.Module.register_parameter(self, name, param)
    def register_on_device(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device != target:
            moved = self._parameters[name]
            assert moved is not None
            new = type(moved)(moved.to(target), requires_grad=moved.requires_grad)
            new.__dict__.update(moved.__dict__)  # keep parallel attributes
            self._parameters[name] = new

    nn.Module.register_parameter = register_on_device  # type: ignore[method-assign]
    try:
        with _counting_meta(target):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
