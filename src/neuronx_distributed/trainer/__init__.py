"""NxD's ``neuronx_distributed.trainer``: the training API of :mod:`nxd_trainer`."""

from neuronx_distributed.trainer import model, trainer
from nxd_trainer import (
    NxDModel,
    initialize_parallel_model,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)

__all__ = [
    "NxDModel",
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "model",
    "neuronx_distributed_config",
    "trainer",
]
