"""NxD's ``neuronx_distributed.parallel_layers``: the layers and helpers of :mod:`nxd_layers`.

``PARALLEL_MODULES`` / ``PARALLEL_FUNCTIONS`` are NxD's lists of what pipeline tracing keeps as
leaves; ``save``/``load`` (the legacy checkpoint API) come from ``checkpointing``.
"""

import importlib
from typing import Any

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
from neuronx_distributed.parallel_layers.grads import clip_grad_norm
from neuronx_distributed.parallel_layers.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    copy_tensor_model_parallel_attributes,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
from neuronx_distributed.parallel_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from neuronx_distributed.parallel_layers.parallel_state import initialize_model_parallel
from neuronx_distributed.parallel_layers.random import (
    get_xla_rng_tracker,
    model_parallel_xla_manual_seed,
)
from neuronx_distributed.parallel_layers.utils import (
    move_model_to_device,
    split_tensor_along_last_dim,
)


def __getattr__(name: str) -> Any:
    """``save``/``load``/``checkpointing`` import nxd-ckpt on first use (layers stay light)."""
    if name in ("save", "load", "checkpointing"):
        checkpointing = importlib.import_module(f"{__name__}.checkpointing")
        return checkpointing if name == "checkpointing" else getattr(checkpointing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PARALLEL_MODULES = [ColumnParallelLinear, RowParallelLinear, ParallelEmbedding]
PARALLEL_FUNCTIONS = [
    parallel_cross_entropy,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
]

__all__ = [
    "PARALLEL_FUNCTIONS",
    "PARALLEL_MODULES",
    "ColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "checkpointing",
    "clip_grad_norm",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_xla_rng_tracker",
    "grads",
    "initialize_model_parallel",
    "layers",
    "load",
    "loss_functions",
    "mappings",
    "model_parallel_xla_manual_seed",
    "move_model_to_device",
    "pad",
    "parallel_cross_entropy",
    "parallel_state",
    "random",
    "reduce_from_tensor_model_parallel_region",
    "save",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "utils",
]
