"""NxD's ``neuronx_distributed.parallel_layers.utils``: sharding attributes and arithmetic."""

from __future__ import annotations

import os

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
    "cast_tensor",
    "copy_tensor_model_parallel_attributes",
    "divide",
    "ensure_divisibility",
    "get_local_world_size",
    "get_padding_length",
    "is_pjrt_device",
    "is_torch_version_greater_than_2",
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
