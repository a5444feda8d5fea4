"""Activation checkpointing: keep a module's inputs, recompute its activations in backward.

For a checkpointed module f, the forward stores only x and y = f(x); backward recomputes
f(x) to get the intermediate activations, trading one extra forward of f for their memory.
Recomputation must draw the same random numbers as the forward (dropout masks), from every
stream: torch's checkpoint restores the default CPU/CUDA generators, and the stream context
below restores the model-parallel streams of ``nxd_state.get_rng_tracker()`` (the masks of
dropout inside tensor-parallel regions) to their state at the original forward. On XLA,
torch's checkpoint cannot save the device generator: torch-xla's (reentrant) checkpoint is
used instead, which does, with the tracker's streams swapped in the same way.

Modules are patched in place (their ``forward`` becomes the checkpointed one): parameter and
module names are unchanged, so state dicts and optimizers see the same model.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import nxd_state

__all__ = ["apply_activation_checkpointing", "checkpointed_modules", "is_checkpointed"]

logger = logging.getLogger(__name__)

_MARK = "_nxd_activation_checkpoint"


Context = contextlib.AbstractContextManager[None]


def _tracker_contexts() -> tuple[Context, Context]:
    """(forward context, recompute context) for torch's ``checkpoint(context_fn=...)``.

    The forward context records the tracker's streams as the forward starts; the recompute
    context swaps those states in for the replay and puts the live ones back afterwards, so
    the replay draws the forward's masks and leaves the streams where backward found them.
    """
    tracker = nxd_state.get_rng_tracker()
    saved: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        live = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(live)

    return forward(), recompute()


def _xla_checkpoint(original: Any, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """torch-xla's checkpoint (reentrant: torch's cannot save XLA's generator, torch-xla's
    does); the tracker's streams are swapped in for the replay here. Keyword arguments are
    bound to the function, so no gradient flows into them (HF layers pass masks and rotary
    tables that way, which need none)."""
    needing_grad = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if needing_grad:
        raise ValueError(
            f"activation checkpointing on XLA: keyword inputs {needing_grad} of "
            f"{type(module).__name__} need gradients; pass them positionally"
        )
    xla_checkpoint = importlib.import_module("torch_xla.utils.checkpoint").checkpoint
    tracker = nxd_state.get_rng_tracker()
    saved: list[dict[str, torch.Tensor]] = []

    def run(*inputs: Any) -> Any:
        if not saved:  # the forward: remember where the streams were
            saved.append(tracker.get_states())
            return original(module, *inputs, **kwargs)
        live = tracker.get_states()
        tracker.set_states(saved[0])
        try:
            return original(module, *inputs, **kwargs)
        finally:
            tracker.set_states(live)

    return xla_checkpoint(run, *args, use_reentrant=True, preserve_rng_state=True)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = type(self).forward
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to recompute
        return original(self, *args, **kwargs)
    if nxd_state.resolve_device_type() == "xla":
        return _xla_checkpoint(original, self, args, kwargs)
    return checkpoint(
        original,
        self,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=_tracker_contexts,
        **kwargs,
    )


def is_checkpointed(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def apply_activation_checkpointing(
    modules: Iterable[tuple[str, nn.Module]], classes: tuple[type, ...]
) -> list[str]:
    """Checkpoint every module of ``classes`` among ``modules`` (``(name, module)`` pairs in
    ``named_modules`` order) that is not inside another checkpointed one; returns their names.

    Nested matches are skipped: the outer module's recompute already recomputes them.
    """
    done: list[str] = []
    for name, module in modules:
        if not isinstance(module, classes) or is_checkpointed(module):
            continue
        if any(name.startswith(prefix + ".") for prefix in done):
            continue
        module.forward = types.MethodType(_checkpointed_forward, module)
        setattr(module, _MARK, True)
        done.append(name)
    logger.info("activation checkpointing on %d modules", len(done))
    return done


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose forward is checkpointed."""
    return [name for name, module in model.named_modules() if is_checkpointed(module)]
