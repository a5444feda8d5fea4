"""NxD's ``neuronx_distributed.trainer``: the training API of :mod:`nxd_trainer`."""

from neuronx_distributed.trainer import checkpoint, model, trainer
from nxd_trainer import (
    NxDModel,
    finalize_checkpoint,
    has_checkpoint,
    initialize_parallel_model,
    initialize_parallel_optimizer,
    load_checkpoint,
    neuronx_distributed_config,
    save_checkpoint,
)

__all__ = [
    "NxDModel",
    "checkpoint",
    "finalize_checkpoint",
    "has_checkpoint",
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "load_checkpoint",
    "model",
    "neuronx_distributed_config",
    "save_checkpoint",
    "trainer",
]
