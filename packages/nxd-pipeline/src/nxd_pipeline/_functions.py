"""Custom ``torch.autograd.Function``s in a captured model: which modules apply them.

A custom Function's backward is its own code, not the derivative of its forward: nxd's
``copy_to_tensor_model_parallel_region`` is ``y = x`` forward and ``dL/dx = Σ_TP dL/dy``
backward. Both capture routes record only the operations a Function's forward runs (a
``view_as``), so a Function traced into a stage graph gets the derivative of its forward (the
identity) instead: under tensor parallelism every gradient upstream of it is one rank's partial
sum. A stage stays correct only if the module applying the Function runs as a module call
(eagerly, Function included). These helpers find those modules, by qualified name (``""``:
the root's own ``forward``), with the Functions each applies:

* :func:`watch_autograd_functions` (``torch.export``, non-strict): the model runs on fake
  tensors with autograd recording, so every applied Function leaves a ``BackwardCFunction``
  node in the autograd graph. Module hooks walk the graph behind each module's inputs (nodes
  made before the module ran: its caller's) and behind its outputs (its own, once its
  submodules have claimed theirs), each node once.
* :class:`FunctionFrames` (``torch.fx``): symbolic tracing runs a Function's forward on
  proxies without autograd; each recorded operation is checked for a Function's ``forward``
  frame on the Python stack.

A ``torch.library`` operator with a registered autograd formula (nxd's TP mappings while
captured, :mod:`nxd_layers._ops`) is not reported: the graph holds it, its backward included.

Functions applied where no gradient flows (inputs without ``requires_grad``, ``no_grad``) leave
no autograd node and are not reported by the export watch: their backward never runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

__all__ = [
    "FunctionFrames",
    "containing",
    "describe",
    "outermost",
    "uncovered",
    "watch_autograd_functions",
]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a (nested) tuple / list / mapping / ``ModelOutput``."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _function_name(node: Any) -> str:
    cls = getattr(type(node), "_forward_cls", None)
    return cls.__qualname__ if cls is not None else type(node).__name__


def _is_operator(node: Any) -> bool:
    """Whether ``node`` is the autograd node of a ``torch.library`` operator with a registered
    backward (nxd's TP collectives while captured): the graph holds the operator, whose
    backward runs with it, so nothing is lost."""
    cls = getattr(type(node), "_forward_cls", None)
    return getattr(cls, "__module__", None) == "torch._library.autograd"


@contextmanager
def watch_autograd_functions(model: nn.Module) -> Iterator[dict[str, set[str]]]:
    """While active, fills ``{module name: {Function name}}`` for the custom autograd Functions
    each module of ``model`` applies in its own code (see the module docstring). Hooks are
    removed on exit."""
    sites: dict[str, set[str]] = {}
    running: list[str] = []
    seen: set[Any] = set()  # autograd nodes already attributed (kept alive: identity is stable)

    def claim(value: Any, owner: str) -> None:
        pending = [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node in seen:
                continue
            seen.add(node)
            if isinstance(node, BackwardCFunction) and not _is_operator(node):
                sites.setdefault(owner, set()).add(_function_name(node))
            pending.extend(n for n, _ in node.next_functions if n is not None and n not in seen)

    names: dict[nn.Module, str] = {}
    for name, sub in model.named_modules():
        names.setdefault(sub, name)

    def before(module: nn.Module, args: Any, kwargs: Any) -> None:
        claim((args, kwargs), running[-1] if running else "")  # made by the caller
        running.append(names[module])

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        claim(output, names[module])
        running.pop()

    handles = []
    for sub in names:
        handles.append(sub.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(sub.register_forward_hook(after, with_kwargs=True, always_call=True))
    try:
        yield sites
    finally:
        for handle in handles:
            handle.remove()


def _function_classes() -> Iterator[type]:
    pending = list(torch.autograd.Function.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        yield cls


class FunctionFrames:
    """Tells, from the Python stack, whether the caller runs inside a custom autograd
    Function's ``forward`` (FX route: the operations it records are that Function's)."""

    def __init__(self) -> None:
        self._codes: dict[CodeType, str] = {}
        for cls in _function_classes():
            forward = cls.__dict__.get("forward")
            code = getattr(getattr(forward, "__func__", forward), "__code__", None)
            if code is not None:
                self._codes[code] = cls.__qualname__

    def current(self) -> str | None:
        """The innermost Function whose ``forward`` is on the stack, or None."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            name = self._codes.get(frame.f_code)
            if name is not None:
                return name
            frame = frame.f_back
        return None


def uncovered(sites: dict[str, set[str]], kept: list[str]) -> dict[str, set[str]]:
    """The sites not inside a module in ``kept`` (which run as calls, Functions included)."""
    return {
        name: functions
        for name, functions in sites.items()
        if not any(name == k or name.startswith(k + ".") for k in kept)
    }


def containing(kept: list[str], sites: dict[str, set[str]]) -> list[str]:
    """The modules of ``kept`` inside which some site is (their calls must stay)."""
    return [k for k in kept if any(n == k or n.startswith(k + ".") for n in sites)]


def outermost(names: list[str]) -> list[str]:
    """``names`` without those nested in another (a module call runs its submodules), in order."""
    return [
        n for n in dict.fromkeys(names) if not any(n.startswith(o + ".") for o in names if o != n)
    ]


def describe(model: nn.Module, sites: dict[str, set[str]]) -> str:
    """``'lm_head' (ColumnParallelLinear) applies _CopyToTensorParallel; ...``"""
    parts = []
    for name, functions in sorted(sites.items()):
        where = (
            f"{name!r} ({type(model.get_submodule(name)).__name__})"
            if name
            else (f"the root's forward ({type(model).__name__})")
        )
        parts.append(f"{where} applies {', '.join(sorted(functions))}")
    return "; ".join(parts)
