"""NxD's ``neuronx_distributed.parallel_layers.loss_functions``."""

from nxd_layers.loss_functions import parallel_cross_entropy

__all__ = ["parallel_cross_entropy"]
