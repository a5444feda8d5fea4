"""NxD's ``neuronx_distributed.parallel_layers.utils``: sharding attributes and arithmetic."""

from __future__ import annotations

import os
from typing import Any

import torch

from nxd_layers import (
    copy_tensor_model_parallel_attributes,
    divide,
    ensure_divisibility,
    move_model_to_device,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from nxd_layers.utils import (
    EmbeddingUtility,
    cast_all,
    cast_tensor,
    get_padding_length,
    is_torch_version_greater_than_2,
    split_tensor_along_dim,
    split_tensor_along_last_dim,
    split_tensor_along_second_dim,
)
from nxd_state import get_local_world_size

__all__ = [
    "EmbeddingUtility",
    "cast_all",
    "cast_if_autocast_enabled",
    "cast_tensor",
    "copy_tensor_model_parallel_attributes",
    "divide",
    "ensure_divisibility",
    "get_local_world_size",
    "get_padding_length",
    "is_pjrt_device",
    "is_torch_version_greater_than_2",
    "move_all_tensor_to_cpu",
    "move_model_to_device",
    "param_is_not_tensor_parallel_duplicate",
    "requires_init_pg_override",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_dim",
    "split_tensor_along_last_dim",
    "split_tensor_along_second_dim",
]


def requires_init_pg_override() -> bool:
    """NxD patched process-group creation on torch 2.0 only; nxd needs torch >= 2.9: never."""
    return False


def is_pjrt_device() -> bool:
    """Whether torch-xla's PJRT runtime drives a Neuron device (``PJRT_DEVICE=NEURON``)."""
    return os.environ.get("PJRT_DEVICE") == "NEURON"


def cast_if_autocast_enabled(*args: Any) -> tuple[Any, ...]:
    """``args`` with every floating-point tensor inside (nested lists, tuples, dicts) cast to
    the autocast dtype of its device when autocast is on there; for custom autograd functions,
    which autocast does not reach."""
    return tuple(_autocast(arg) for arg in args)


def _autocast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        kind = value.device.type
        if value.is_floating_point() and torch.is_autocast_enabled(kind):
            return value.to(torch.get_autocast_dtype(kind))
        return value
    if isinstance(value, dict):
        return {key: _autocast(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_autocast(item) for item in value)
    return value


def move_all_tensor_to_cpu(data: Any, convert: bool = True) -> Any:
    """``data`` with every tensor inside (nested lists, tuples, dicts) moved to the CPU (XLA's
    pending graph is run first); ``convert=False`` only runs it and returns ``data`` as is."""
    import nxd_state

    nxd_state.mark_step()
    return _to_cpu(data) if convert else data


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value
