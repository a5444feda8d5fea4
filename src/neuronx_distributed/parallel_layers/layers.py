"""NxD's ``neuronx_distributed.parallel_layers.layers``: the parallel layers of nxd_layers."""

from nxd_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear

__all__ = ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear"]
