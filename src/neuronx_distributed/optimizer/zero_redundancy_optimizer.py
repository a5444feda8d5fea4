"""NxD's ``neuronx_distributed.optimizer.zero_redundancy_optimizer``."""

from nxd_optim import NeuronZero1Optimizer

__all__ = ["NeuronZero1Optimizer"]
