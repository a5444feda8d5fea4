"""NxD's ``neuronx_distributed.parallel_layers.utils``: sharding attributes and arithmetic."""

from nxd_layers import (
    copy_tensor_model_parallel_attributes,
    divide,
    ensure_divisibility,
    move_model_to_device,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "copy_tensor_model_parallel_attributes",
    "divide",
    "ensure_divisibility",
    "move_model_to_device",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]
