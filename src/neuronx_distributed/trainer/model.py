"""NxD's ``neuronx_distributed.trainer.model``."""

from nxd_trainer import NxDModel

__all__ = ["NxDModel"]
