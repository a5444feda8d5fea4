"""NxD's ``neuronx_distributed.parallel_layers``: the layers and helpers of :mod:`nxd_layers`."""

from neuronx_distributed.parallel_layers import (
    grads,
    layers,
    loss_functions,
    mappings,
    pad,
    parallel_state,
    random,
    utils,
)
from nxd_layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    clip_grad_norm,
    move_model_to_device,
    parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "clip_grad_norm",
    "grads",
    "layers",
    "loss_functions",
    "mappings",
    "move_model_to_device",
    "pad",
    "parallel_cross_entropy",
    "parallel_state",
    "random",
    "utils",
]
