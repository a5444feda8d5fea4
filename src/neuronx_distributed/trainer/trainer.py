"""NxD's ``neuronx_distributed.trainer.trainer``."""

from nxd_trainer import (
    initialize_parallel_model,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)

__all__ = [
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "neuronx_distributed_config",
]
