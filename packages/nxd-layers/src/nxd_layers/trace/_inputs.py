"""Example inputs, bucket signatures and the bytes that carry tensors between processes.

A call's inputs are a tuple of positional arguments (a pytree: tensors, nested tuples / lists /
dicts, Python scalars). Its *signature* is the tree structure plus, per leaf, the tensor's dtype
and shape or the scalar's value: a traced program (one per bucket) runs exactly the inputs of
its signature, so a call is matched to a bucket by signature, in the caller, before any worker
is asked to run (a wrong shape is an error there, not a hang in the workers).

On the wire a tensor travels as its dtype, shape and raw bytes (no shared-memory handles, no
pickled tensor objects); the messages themselves are pickled tuples of plain values between
the caller and its own workers.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "Signature",
    "decode",
    "describe",
    "encode",
    "find_bucket",
    "normalize_args",
    "signature",
]

Signature = dict[str, Any]  # {"tree": str, "leaves": [["tensor", dtype, shape] | ["value", v]]}


def normalize_args(example: Any, what: str = "example_inputs") -> tuple[Any, ...]:
    """NxD's ``example_inputs``: one tensor, or a tuple / list of positional arguments."""
    if isinstance(example, torch.Tensor):
        return (example,)
    if isinstance(example, tuple | list):
        if not example:
            raise ValueError(f"{what} is empty; pass the model's positional inputs")
        return tuple(example)
    raise ValueError(
        f"{what} must be a tensor or a tuple/list of the model's positional inputs, got "
        f"{type(example).__name__}"
    )


def _leaf_signature(leaf: Any) -> list[Any]:
    if isinstance(leaf, torch.Tensor):
        return ["tensor", str(leaf.dtype).removeprefix("torch."), list(leaf.shape)]
    if leaf is None or isinstance(leaf, bool | int | float | str):
        return ["value", leaf]
    raise ValueError(
        f"inputs may hold tensors, Python scalars, strings and None, got a {type(leaf).__name__}"
    )


def signature(args: tuple[Any, ...]) -> Signature:
    """The structure and per-leaf dtype/shape (or value) of ``args``, JSON-ready."""
    leaves, spec = pytree.tree_flatten(args)
    return {"tree": pytree.treespec_dumps(spec), "leaves": [_leaf_signature(x) for x in leaves]}


def describe(sig: Signature) -> str:
    """``(float32[2, 8, 32], int64[2, 8])``: a signature's leaves, for error messages."""
    parts = []
    for leaf in sig["leaves"]:
        parts.append(f"{leaf[1]}{leaf[2]}" if leaf[0] == "tensor" else repr(leaf[1]))
    return "(" + ", ".join(parts) + ")"


def find_bucket(buckets: list[Signature], args: tuple[Any, ...]) -> int:
    """The index of the bucket whose signature ``args`` has; a ValueError naming the
    offending shapes and the traced ones otherwise."""
    sig = signature(args)
    for index, bucket in enumerate(buckets):
        if bucket == sig:
            return index
    traced = "; ".join(describe(b) for b in buckets)
    if len(buckets) == 1 and buckets[0]["tree"] == sig["tree"]:
        for i, (got, want) in enumerate(zip(sig["leaves"], buckets[0]["leaves"])):
            if got != want:
                raise ValueError(
                    f"input leaf {i} is {got[1]}{got[2] if got[0] == 'tensor' else ''}, but the "
                    f"traced program takes {want[1]}{want[2] if want[0] == 'tensor' else ''} "
                    f"(traced inputs {traced}); trace a bucket for this shape "
                    f"(bucket_config=[...])"
                )
    raise ValueError(
        f"inputs {describe(sig)} match no traced bucket; traced: {traced} (the input structure "
        f"and every tensor's dtype and shape must equal one bucket's example inputs)"
    )


class _Raw:
    """A tensor as dtype name, shape and bytes (picklable without torch's reductions)."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.shape = tuple(tensor.shape)
        self.data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""

    def tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return flat.view(dtype).reshape(self.shape)


def encode(obj: Any) -> bytes:
    """Bytes carrying ``obj`` (a pytree of tensors and plain values) to another process."""
    leaves, spec = pytree.tree_flatten(obj)
    packed = [_Raw(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    return pickle.dumps((pytree.treespec_dumps(spec), packed))


def decode(data: bytes, device: torch.device | str | None = None) -> Any:
    """Inverse of :func:`encode`; tensors land on ``device`` (CPU by default)."""
    spec, packed = pickle.loads(data)  # written by this package's other end of the pipe
    leaves = []
    for item in packed:
        if isinstance(item, _Raw):
            tensor = item.tensor()
            leaves.append(tensor.to(device) if device is not None else tensor)
        else:
            leaves.append(item)
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(spec))
