"""NxD's ``neuronx_distributed.parallel_layers.layers``: the parallel layers of nxd_layers.

``create_local_weight`` and ``_initialize_parameter_cpu`` read this rank's TP rank and size
through the module-level names ``get_tensor_model_parallel_rank`` /
``get_tensor_model_parallel_size`` when they run, so a test that patches them here
(``patch("neuronx_distributed.parallel_layers.layers.get_tensor_model_parallel_rank")``, as
NxD's unit tests do) changes what those functions compute. The layer classes take their rank
and size from their own process group instead (``tensor_parallel_group``): patching the names
here does not change them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
from nxd_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
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
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_size",
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


def _initialize_parameter_cpu(
    param: torch.Tensor,
    partition_dim: int,
    num_partitions: int,
    init_method: Callable[[torch.Tensor], Any],
    return_master_param: bool = False,
    *,
    param_dtype: torch.dtype = torch.float32,
    stride: int = 1,
) -> torch.Tensor | None:
    """NxD's helper: ``param`` (this rank's shard, already the shard's shape) <- its slice of a
    full master ``M`` drawn as ``init_method(M)`` in float32 on CPU, ``M`` of ``param``'s shape
    with ``partition_dim`` times the TP size, cast to ``param_dtype``; the sharding attributes
    are set. Returns ``M`` (in ``param_dtype``) with ``return_master_param``, else None.

    ``num_partitions`` must equal the TP size (the master is cut into that many shards).
    """
    world = get_tensor_model_parallel_size()
    if num_partitions != world:
        raise ValueError(
            f"_initialize_parameter_cpu: num_partitions={num_partitions} but the tensor "
            f"parallel size is {world}"
        )
    set_tensor_model_parallel_attributes(param, True, partition_dim, stride)
    shape = list(param.shape)
    shape[partition_dim] *= world
    master = torch.empty(shape, dtype=torch.float32)
    with torch.no_grad():
        init_method(master)
    master = master.to(param_dtype)
    create_local_weight(master, partition_dim, param.shape[partition_dim], stride, param)
    return master if return_master_param else None
