"""NxD's ``neuronx_distributed.parallel_layers.layers``: the parallel layers of nxd_layers."""

from nxd_layers import (
    BaseParallelConv,
    BaseParallelLinear,
    ColumnParallelLinear,
    InputChannelParallelConv2d,
    OutputChannelParallelConv2d,
    ParallelEmbedding,
    RowParallelLinear,
    copy_tensor_model_parallel_attributes,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "BaseParallelConv",
    "BaseParallelLinear",
    "ColumnParallelLinear",
    "InputChannelParallelConv2d",
    "OutputChannelParallelConv2d",
    "ParallelEmbedding",
    "RowParallelLinear",
    "copy_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]
