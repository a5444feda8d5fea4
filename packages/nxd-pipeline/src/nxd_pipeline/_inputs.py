"""Split a batch into microbatches along dim 0, for the traced and the manual mode.

Microbatch ``k`` of ``m`` holds rows ``[k·b/m, (k+1)·b/m)`` of every batch tensor. The signature
(names, shapes and dtypes of the first microbatch) keys the p2p header cache: a new signature
sends new headers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["signature", "split_manual", "split_traced"]


def signature(microbatch: dict[str, Any]) -> Hashable:
    """Names, shapes and dtypes of a microbatch's tensors (reprs of other values)."""
    out = []
    for name, value in sorted(microbatch.items()):
        leaves, spec = pytree.tree_flatten(value)
        described = tuple(
            (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
        )
        out.append((name, str(spec), described))
    return tuple(out)


def _check_rows(name: str, tensor: torch.Tensor, m: int) -> None:
    if tensor.dim() == 0 or tensor.shape[0] % m != 0:
        raise ValueError(
            f"input {name!r} of shape {tuple(tensor.shape)}: batch size must be divisible by "
            f"num_microbatches={m}"
        )


def split_traced(
    kwargs: dict[str, Any], input_names: Sequence[str], fixed: dict[str, Any], m: int
) -> list[dict[str, Any]]:
    """Traced mode: the keyword arguments must be exactly the traced inputs."""
    missing = [n for n in input_names if n not in kwargs]
    unknown = [n for n in kwargs if n not in input_names]
    if missing or unknown:
        raise ValueError(
            f"run_train/run_eval take the traced inputs {list(input_names)}; missing "
            f"{missing}, unexpected {unknown}"
        )
    chunks: dict[str, list[Any]] = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            _check_rows(name, value, m)
            chunks[name] = list(value.chunk(m, dim=0))
        else:
            chunks[name] = [value] * m
    return [{**fixed, **{n: chunks[n][i] for n in chunks}} for i in range(m)]


def _tensor_list(name: str, value: Any) -> list[torch.Tensor]:
    items = [value] if isinstance(value, torch.Tensor) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(
            f"run_train/run_eval: {name} must be a tensor or a list/tuple of tensors, got "
            f"{type(value).__name__}"
        )
    return list(items)


def split_manual(kwargs: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """Manual mode (NxD's ``run_train(inputs=..., labels=...)``): each microbatch's ``inputs``
    and ``labels`` are lists of row slices (a tensor counts as a list of one)."""
    unknown = sorted(set(kwargs) - {"inputs", "labels"})
    if "inputs" not in kwargs or unknown:
        raise ValueError(
            f"with manual_pp_partition, run_train/run_eval take inputs=... and labels=...; got "
            f"{sorted(kwargs)}"
        )
    parts: dict[str, list[list[torch.Tensor]] | None] = {}
    for name in ("inputs", "labels"):
        value = kwargs.get(name)
        if value is None:
            parts[name] = None
            continue
        tensors = _tensor_list(name, value)
        rows = {tuple(t.shape[:1]) for t in tensors}
        if len(rows) != 1:
            raise ValueError(
                f"run_train/run_eval: the tensors in {name} have different batch sizes "
                f"{[tuple(t.shape) for t in tensors]}"
            )
        for tensor in tensors:
            _check_rows(name, tensor, m)
        per_tensor = [t.chunk(m, dim=0) for t in tensors]
        parts[name] = [[chunks[i] for chunks in per_tensor] for i in range(m)]
    return [
        {name: (value[i] if value is not None else None) for name, value in parts.items()}
        for i in range(m)
    ]
