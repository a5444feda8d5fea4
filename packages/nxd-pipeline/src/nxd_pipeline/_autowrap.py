"""What FX records as one call instead of tracing into: nxd's parallel functions (their
autograd Functions must run eagerly to keep their backward) and NxD's
``autowrap_obj_methods``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["check_obj_methods", "nxd_functions", "wrapped_methods"]

_MISSING = object()  # a method the object did not hold itself (its class defines it)


def nxd_functions() -> tuple[Callable[..., Any], ...]:
    """nxd's TP mapping and parallel loss functions: FX records each as one call (their
    autograd Functions then run eagerly), as NxD's tracer autowraps its parallel functions."""
    try:
        from nxd_layers import loss_functions, mappings
    except ImportError:  # pragma: no cover - nxd-layers is a dependency
        return ()
    found = [getattr(mappings, name) for name in mappings.__all__]
    found += [
        loss_functions.parallel_cross_entropy,
        loss_functions.from_parallel_logits_to_logprobs,
    ]
    return tuple(fn for fn in found if callable(fn))


def check_obj_methods(obj_methods: Mapping[Any, Sequence[str]] | None) -> None:
    """NxD's ``autowrap_obj_methods``: ``{obj: ["method", ...]}``, each a method of ``obj``."""
    if obj_methods is None:
        return
    if not isinstance(obj_methods, Mapping):
        raise TypeError(
            f"autowrap_obj_methods maps objects to lists of method names, got "
            f"{type(obj_methods).__name__}"
        )
    for obj, methods in obj_methods.items():
        if isinstance(methods, str) or not isinstance(methods, Sequence):
            raise TypeError(
                f"autowrap_obj_methods maps an object to a list of method names; got "
                f"{methods!r} for a {type(obj).__name__}"
            )
        for name in methods:
            if not isinstance(name, str) or not callable(getattr(obj, name, None)):
                raise ValueError(
                    f"autowrap_obj_methods: a {type(obj).__name__} has no method {name!r}"
                )


def _graph_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` recorded as one ``call_function`` node when called on a proxy."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        proxy = next((a for a in leaves if isinstance(a, fx.Proxy)), None)
        if proxy is None:
            return method(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", method, args, kwargs)

    return call


@contextmanager
def wrapped_methods(obj_methods: Mapping[Any, Sequence[str]] | None) -> Iterator[None]:
    """NxD's ``autowrap_obj_methods``: while tracing, ``obj.method(...)`` is not traced into
    but recorded as one call of the original bound method."""
    check_obj_methods(obj_methods)
    patched: list[tuple[Any, str, Any]] = []
    try:
        for obj, methods in (obj_methods or {}).items():
            for name in methods:
                own = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
                patched.append((obj, name, own))
                setattr(obj, name, _graph_call(getattr(obj, name)))
        yield
    finally:
        for obj, name, own in reversed(patched):
            if own is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
