"""Python values as JSON, with tensors kept aside (they go to safetensors): no pickle.

Encodes dicts (str or int keys), lists, tuples, str, int, float (inf and nan included), bool,
None, ``torch.dtype`` and tensors; a tensor becomes ``{"__tensor__": name}`` and lands in
the ``tensors`` map under ``name``. Anything else is refused with the path of the value, so a
save never silently drops user content. Decoding executes no code. Containers nest at most
``MAX_DEPTH`` levels (deeper values are refused at save, and an index holding one at load,
before any recursion could overflow); :func:`check_encoded` validates an encoded value read
from an index without recursion.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nxd_ckpt.format._records import FormatError

__all__ = ["MAX_DEPTH", "check_encoded", "decode", "encode"]

MAX_DEPTH = 100
"""Most nested containers (dicts, lists, tuples) a stored value may have."""


def encode(
    value: Any, tensors: dict[str, torch.Tensor], path: str, what: str, depth: int = 0
) -> Any:
    """The JSON form of ``value``; tensors are added to ``tensors`` keyed by their path."""
    if depth > MAX_DEPTH:
        raise TypeError(
            f"cannot save {what}: the value at '{path}' nests containers more than "
            f"{MAX_DEPTH} levels deep"
        )
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach()
        return {"__tensor__": path}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(
                    f"cannot save {what}: key {key!r} at '{path}' is a {type(key).__name__}; "
                    f"only str and int keys can be stored without pickle"
                )
            items.append([key, encode(item, tensors, f"{path}.{key}", what, depth + 1)])
        return {"__dict__": items}
    if isinstance(value, (list, tuple)):
        encoded = [encode(v, tensors, f"{path}.{i}", what, depth + 1) for i, v in enumerate(value)]
        return {"__tuple__": encoded} if isinstance(value, tuple) else encoded
    raise TypeError(
        f"cannot save {what}: the value at '{path}' is a {type(value).__module__}."
        f"{type(value).__qualname__}; checkpoints store dicts, lists, tuples, numbers, strings, "
        f"None, dtypes and tensors only (no pickle) — convert it first"
    )


def decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__tuple__" in value:
        return tuple(decode(v, tensors) for v in value["__tuple__"])
    if "__float__" in value:
        return float(value["__float__"])
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    return {key: decode(item, tensors) for key, item in value["__dict__"]}


def tensor_paths(value: Any) -> list[str]:
    """Every tensor reference inside an encoded value."""
    if isinstance(value, list):
        return [p for v in value for p in tensor_paths(v)]
    if not isinstance(value, dict):
        return []
    if "__tensor__" in value:
        return [value["__tensor__"]]
    if "__tuple__" in value:
        return tensor_paths(value["__tuple__"])
    if "__dict__" in value:
        return [p for _, v in value["__dict__"] for p in tensor_paths(v)]
    return []


def check_encoded(value: Any, tensors: set[str], where: str) -> None:
    """Raise FormatError unless ``value`` is what :func:`encode` writes: JSON scalars, lists,
    and the ``__dict__`` / ``__tuple__`` / ``__tensor__`` (naming one of ``tensors``) /
    ``__float__`` / ``__dtype__`` forms, nested at most ``MAX_DEPTH`` containers deep.
    Iterative: a hostile depth cannot overflow the stack."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, (bool, int, float, str)):
            continue
        if depth >= MAX_DEPTH:
            raise FormatError(f"{where}: nested more than {MAX_DEPTH} containers deep")
        if isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
            continue
        if not isinstance(item, dict) or len(item) != 1:
            raise FormatError(f"{where}: {_short(item)} is not an encoded value")
        ((form, inner),) = item.items()
        stack.extend((child, depth + 1) for child in _children(form, inner, item, tensors, where))


def _children(form: Any, inner: Any, item: Any, tensors: set[str], where: str) -> list[Any]:
    """The values nested in one encoded form ``{form: inner}``, after checking the form."""
    if form == "__tensor__":
        if not isinstance(inner, str) or inner not in tensors:
            raise FormatError(f"{where}: refers to tensor {inner!r}, which is not stored")
        return []
    if form == "__tuple__" and isinstance(inner, list):
        return inner
    if form == "__float__" and isinstance(inner, str):
        try:
            float(inner)
        except ValueError:
            raise FormatError(f"{where}: {inner!r} is not a float") from None
        return []
    if form == "__dtype__" and isinstance(inner, str):
        if not isinstance(getattr(torch, inner, None), torch.dtype):
            raise FormatError(f"{where}: unknown dtype {inner!r}")
        return []
    if form == "__dict__" and isinstance(inner, list):
        for pair in inner:
            ok = isinstance(pair, list) and len(pair) == 2
            if not ok or isinstance(pair[0], bool) or not isinstance(pair[0], (str, int)):
                raise FormatError(f"{where}: {_short(pair)} is not a [key, value] pair")
        return [pair[1] for pair in inner]
    raise FormatError(f"{where}: {_short(item)} is not an encoded value")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
