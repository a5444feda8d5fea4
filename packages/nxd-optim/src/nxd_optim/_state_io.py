"""Optimizer state on disk without pickle: tensors in safetensors, structure in JSON.

A nested state (dicts with int or str keys, lists, tuples, numbers, strings, None, tensors) is
split into a flat ``{name: tensor}`` map and a JSON skeleton in which every tensor is replaced
by ``{"__tensor__": name}``. Loading executes no code. Files are written under a temporary
name and renamed, so a crash mid-save leaves no half-written file under the final name.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["decode_state", "encode_state", "read_state", "write_state"]

logger = logging.getLogger(__name__)
_FORMAT = "nxd-optim/1"


def encode_state(state: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """The JSON skeleton of ``state``; its tensors go to ``tensors`` under their path."""
    if isinstance(state, torch.Tensor):
        tensors[path] = state.detach().to("cpu").contiguous().clone()
        return {"__tensor__": path}
    if isinstance(state, dict):
        items = []
        for key, value in state.items():
            if not isinstance(key, (int, str)) or isinstance(key, bool):
                raise TypeError(f"state key {key!r} at '{path}' must be an int or a str")
            items.append([key, encode_state(value, tensors, f"{path}.{key}" if path else str(key))])
        return {"__dict__": items}
    if isinstance(state, (list, tuple)):
        encoded = [encode_state(v, tensors, f"{path}.{i}") for i, v in enumerate(state)]
        return {"__tuple__": encoded} if isinstance(state, tuple) else encoded
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TypeError(
        f"cannot store {type(state).__name__} at '{path}' in an optimizer checkpoint: expected "
        f"tensors, numbers, strings, None, lists, tuples or dicts"
    )


def decode_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_state`."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(decode_state(v, tensors) for v in skeleton["__tuple__"])
        return {key: decode_state(value, tensors) for key, value in skeleton["__dict__"]}
    if isinstance(skeleton, list):
        return [decode_state(v, tensors) for v in skeleton]
    return skeleton


def write_state(state: Any, prefix: Path, meta: dict[str, Any]) -> None:
    """Write ``prefix.safetensors`` and ``prefix.json`` (skeleton and ``meta``), atomically."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_state(state, tensors)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tensor_path = prefix.with_name(prefix.name + ".safetensors")
    json_path = prefix.with_name(prefix.name + ".json")
    tmp_tensors = tensor_path.with_name(tensor_path.name + ".tmp")
    tmp_json = json_path.with_name(json_path.name + ".tmp")
    save_file(tensors, str(tmp_tensors), metadata={"format": _FORMAT})
    tmp_json.write_text(json.dumps({"format": _FORMAT, "meta": meta, "state": skeleton}))
    os.replace(tmp_tensors, tensor_path)
    os.replace(tmp_json, json_path)
    logger.info("wrote %d optimizer tensors to %s", len(tensors), tensor_path)


def read_state(prefix: Path, device: torch.device | str = "cpu") -> tuple[Any, dict[str, Any]]:
    """Read what :func:`write_state` wrote: ``(state, meta)``."""
    json_path = prefix.with_name(prefix.name + ".json")
    tensor_path = prefix.with_name(prefix.name + ".safetensors")
    for path in (json_path, tensor_path):
        if not path.exists():
            raise FileNotFoundError(f"optimizer checkpoint file {path} does not exist")
    document = json.loads(json_path.read_text())
    if document.get("format") != _FORMAT:
        raise ValueError(f"{json_path} has format {document.get('format')!r}, expected {_FORMAT}")
    tensors = load_file(str(tensor_path), device=str(device))
    return decode_state(document["state"], tensors), document["meta"]
