"""How a worker finds the user's ``func``: by module and qualified name, never by pickling it.

A fresh worker imports ``module`` and walks ``qualname``; when the module is not importable by
name (a script run as ``__main__``, a test file collected by path) the defining file is loaded
from ``path`` instead. A ``functools.partial`` keeps its bound arguments, pickled (they are the
user's values, e.g. a checkpoint path), around the function's reference.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FuncRef", "make_ref", "resolve"]


@dataclass(frozen=True)
class FuncRef:
    """Where ``func`` lives, and the arguments a ``functools.partial`` binds to it."""

    module: str
    """The defining module's import name (``__main__`` for a script)."""
    qualname: str
    """The function's qualified name inside that module."""
    path: str | None
    """The defining file, loaded directly when ``module`` cannot be imported by name."""
    bound: bytes = b""
    """``pickle.dumps((args, keywords))`` of a ``functools.partial``; empty otherwise."""


def make_ref(func: Any) -> FuncRef:
    """A :class:`FuncRef` for a module-level function (or a partial of one); a clear error for
    anything a fresh process cannot find (a lambda, a nested function, a non-callable)."""
    bound = b""
    target = func
    if isinstance(func, functools.partial):
        target = func.func
        try:
            bound = pickle.dumps((func.args, func.keywords))
        except Exception as error:
            raise ValueError(
                f"func is a functools.partial whose bound arguments cannot be sent to the "
                f"workers ({error}); bind only picklable values"
            ) from error
    if not callable(target):
        raise ValueError(f"func must be a callable returning (model, state_dict), got {func!r}")
    qualname = getattr(target, "__qualname__", "")
    module = getattr(target, "__module__", None)
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname or module is None:
        raise ValueError(
            f"func must be a module-level function (the workers import it by name), got "
            f"{qualname or target!r}; move it to the top level of a module"
        )
    try:
        path: str | None = str(Path(inspect.getfile(target)).resolve())
    except TypeError:  # builtins and C functions have no file
        path = None
    return FuncRef(module=module, qualname=qualname, path=path, bound=bound)


def _walk(owner: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        owner = getattr(owner, part)
    return owner


def _load_by_path(path: str) -> Any:
    name = f"_nxd_trace_func_{abs(hash(path))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def resolve(ref: FuncRef) -> Callable[[], Any]:
    """The callable ``ref`` names (with its partial arguments bound), in this process."""
    candidates = []
    if ref.module in ("__main__", "__mp_main__"):
        candidates = [sys.modules.get("__mp_main__"), sys.modules.get("__main__")]
    else:
        try:
            candidates = [importlib.import_module(ref.module)]
        except ImportError:
            candidates = []
    target = None
    for module in candidates:
        if module is None:
            continue
        try:
            target = _walk(module, ref.qualname)
            break
        except AttributeError:
            continue
    if target is None:
        if ref.path is None:
            raise ImportError(f"cannot find func {ref.module}.{ref.qualname} in the worker")
        target = _walk(_load_by_path(ref.path), ref.qualname)
    if ref.bound:
        args, keywords = pickle.loads(ref.bound)  # the caller's own values, sent by it
        return functools.partial(target, *args, **keywords)
    return target
