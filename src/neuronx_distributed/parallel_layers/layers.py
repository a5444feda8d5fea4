"""NxD's ``neuronx_distributed.parallel_layers.layers``: the parallel layers of nxd_layers."""

from __future__ import annotations

import torch

from nxd_layers import (
    BaseParallelConv,
    BaseParallelLinear,
    ColumnParallelLinear,
    InputChannelParallelConv2d,
    OutputChannelParallelConv2d,
    ParallelEmbedding,
    RowParallelLinear,
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_for_rank,
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
    "create_local_weight",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]


def create_local_weight(
    full_weight: torch.Tensor,
    partition_dim: int,
    per_partition_size: int,
    stride: int,
    out_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """This TP rank's shard of ``full_weight``: ``full_weight`` cut along ``partition_dim`` into
    pieces of ``per_partition_size / stride``, pieces ``rank, rank + tp, ...`` concatenated
    (NxD's strided layout); written into ``out_weight`` when given."""
    from nxd_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_size

    world = get_tensor_model_parallel_size()
    expected = world * per_partition_size
    if full_weight.shape[partition_dim] != expected:
        raise ValueError(
            f"create_local_weight: full_weight has {full_weight.shape[partition_dim]} along dim "
            f"{partition_dim}, expected tp({world}) x per_partition_size({per_partition_size}) = "
            f"{expected}"
        )
    local = shard_for_rank(
        full_weight, partition_dim, get_tensor_model_parallel_rank(), world, stride
    )
    if out_weight is None:
        return local
    with torch.no_grad():
        return out_weight.copy_(local)
