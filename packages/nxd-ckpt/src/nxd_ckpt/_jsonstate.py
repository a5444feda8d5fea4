"""Python values as JSON, with tensors kept aside (they go to safetensors): no pickle.

Encodes dicts (str or int keys), lists, tuples, str, int, float (inf and nan included), bool,
None, ``torch.dtype`` and tensors; a tensor becomes ``{"__tensor__": name}`` and lands in
the ``tensors`` map under ``name``. Anything else is refused with the path of the value, so a
save never silently drops user content. Decoding executes no code.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["decode", "encode"]


def encode(value: Any, tensors: dict[str, torch.Tensor], path: str, what: str) -> Any:
    """The JSON form of ``value``; tensors are added to ``tensors`` keyed by their path."""
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
            items.append([key, encode(item, tensors, f"{path}.{key}", what)])
        return {"__dict__": items}
    if isinstance(value, (list, tuple)):
        encoded = [encode(v, tensors, f"{path}.{i}", what) for i, v in enumerate(value)]
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
