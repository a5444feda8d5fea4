"""NxD's ``neuronx_distributed.utils.serialization``: objects with their tensors split out.

A nested object (tuples, named tuples, lists, sets, dicts, plain values, tensors) is turned into
the same structure with every tensor ``t`` replaced by a :class:`TensorMeta` stub
``(index, dtype, shape, requires_grad, device)`` plus the list of the tensors in stub order, so
the structure can travel as a small Python object and the tensors as tensors;
:meth:`SerializationManager.deserialize` puts them back. Objects of other classes are kept as
they are (not searched for tensors). :func:`find_loss_from_output_and_spec` picks the loss out
of an output with a boolean spec of the same shape (``True`` marks it).

``compress_to_string`` / ``uncompress_from_string`` pickle to base64 text: only for text this
job produced itself (unpickling runs code), never for files from elsewhere.
"""

from __future__ import annotations

import base64
import collections
import pickle
from collections.abc import Callable
from contextlib import contextmanager
from enum import Enum
from typing import Any, NamedTuple

import torch

__all__ = [
    "SerializationManager",
    "TensorMeta",
    "compress_to_string",
    "find_loss_from_output_and_spec",
    "is_instance_namedtuple",
    "uncompress_from_string",
]

_PLAIN = (bool, str, bytes, bytearray, int, float, Enum, type(None))


def compress_to_string(obj: Any) -> str:
    """``obj`` pickled and base64-encoded."""
    return base64.b64encode(pickle.dumps(obj)).decode("utf-8")


def uncompress_from_string(serialized: str) -> Any:
    """The object :func:`compress_to_string` encoded (trusted text only: it unpickles)."""
    return pickle.loads(base64.b64decode(serialized.encode("utf-8")))


def is_instance_namedtuple(value: Any) -> bool:
    """Whether ``value`` is a named tuple (a tuple subclass with ``_fields``)."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def find_loss_from_output_and_spec(output_val: Any, spec_val: Any) -> torch.Tensor | None:
    """The tensor of ``output_val`` at the place ``spec_val`` marks True (``False``: none
    here); tuples/lists and dicts are searched in order and must match the spec's length /
    keys. A spec that marks nothing, or marks a non-tensor, is an error."""
    if spec_val is False:
        return None
    if spec_val is True:
        if not isinstance(output_val, torch.Tensor):
            raise RuntimeError(f"Loss spec must specify a tensor value but got {output_val}")
        return output_val
    if isinstance(spec_val, (tuple, list)):
        if not isinstance(output_val, (tuple, list)) or len(output_val) != len(spec_val):
            raise RuntimeError(
                f"Output value {output_val} must match type and length of loss specification "
                f"{spec_val}"
            )
        pairs = list(zip(output_val, spec_val))
    elif isinstance(spec_val, dict):
        if not isinstance(output_val, dict) or set(output_val) != set(spec_val):
            raise RuntimeError(
                f"Output value {output_val} must match type and keys of loss specification "
                f"{spec_val}"
            )
        pairs = [(output_val[key], spec_val[key]) for key in spec_val]
    else:
        raise RuntimeError(f"Unsupported type {type(spec_val)} in loss specification")
    for out, spec in pairs:
        found = find_loss_from_output_and_spec(out, spec)
        if found is not None:
            return found
    raise RuntimeError(f"Did not find loss value in specification {spec_val}")


class TensorMeta(NamedTuple):
    """The stub a tensor is replaced by: its position in the tensor list and what it was."""

    tensor_index: int
    dtype: torch.dtype
    shape: torch.Size
    requires_grad: bool
    device: torch.device


def _rebuild(original: Any, items: list[Any]) -> Any:
    if is_instance_namedtuple(original):
        return type(original)(*items)
    return type(original)(items)


def _new_dict(original: dict) -> dict:
    if type(original) is collections.defaultdict:
        return collections.defaultdict(original.default_factory)
    return type(original)()


class SerializationManager:
    """``serialize(obj) -> (stubbed, tensors, stubs)``; ``deserialize(stubbed, tensors)``."""

    @contextmanager
    def catch_and_raise_for_large_object(self, obj: Any) -> Any:
        try:
            yield
        except RecursionError as error:
            raise RuntimeError(type(obj).__name__) from error

    def serialize(self, obj: Any, return_stub_list: bool = True) -> tuple[Any, ...]:
        tensors: list[torch.Tensor] = []
        stubs: list[TensorMeta] = []
        with self.catch_and_raise_for_large_object(obj):
            stubbed = self._strip(obj, {}, tensors, stubs)
        return (stubbed, tensors, stubs) if return_stub_list else (stubbed, tensors)

    def deserialize(self, stubbed_obj: Any, tensors: list[torch.Tensor]) -> Any:
        with self.catch_and_raise_for_large_object(stubbed_obj):
            return self._traverse_object(stubbed_obj, tensors, lambda stub, ts: ts[stub[0]])

    def extract_stubs(self, stubbed_obj: Any) -> list[TensorMeta]:
        stubs: list[TensorMeta] = []

        def keep(stub: TensorMeta, found: list[TensorMeta]) -> TensorMeta:
            found.append(stub)
            return stub

        with self.catch_and_raise_for_large_object(stubbed_obj):
            self._traverse_object(stubbed_obj, stubs, keep)
        return stubs

    def _traverse_object(self, obj: Any, tensors: Any, callback: Callable[..., Any]) -> Any:
        """``obj`` rebuilt with every stub replaced by ``callback(stub, tensors)``."""
        if isinstance(obj, TensorMeta):
            return callback(obj, tensors)
        if isinstance(obj, _PLAIN):
            return obj
        if isinstance(obj, (list, tuple, set)) and not isinstance(obj, torch.Size):
            return _rebuild(obj, [self._traverse_object(i, tensors, callback) for i in obj])
        if isinstance(obj, dict):
            out = _new_dict(obj)
            for key, value in obj.items():
                new_key = self._traverse_object(key, tensors, callback)
                out[new_key] = self._traverse_object(value, tensors, callback)
            return out
        return obj

    def _strip(
        self, obj: Any, memo: dict[int, Any], tensors: list[torch.Tensor], stubs: list[TensorMeta]
    ) -> Any:
        """``obj`` with tensors replaced by stubs (a tensor met twice gets one stub)."""
        if id(obj) in memo:
            return memo[id(obj)]
        if isinstance(obj, _PLAIN):
            return obj
        if isinstance(obj, torch.Tensor):
            stub = TensorMeta(len(tensors), obj.dtype, obj.size(), obj.requires_grad, obj.device)
            tensors.append(obj)
            stubs.append(stub)
            memo[id(obj)] = stub
            return stub
        if isinstance(obj, (list, tuple, set)) and not isinstance(obj, torch.Size):
            out = _rebuild(obj, [self._strip(i, memo, tensors, stubs) for i in obj])
        elif isinstance(obj, dict):
            out = _new_dict(obj)
            for key, value in obj.items():
                out[self._strip(key, memo, tensors, stubs)] = self._strip(
                    value, memo, tensors, stubs
                )
        else:
            out = obj  # another class: kept as is
        memo[id(obj)] = out
        return out
