"""NxD's ``neuronx_distributed.optimizer``: ZeRO-1 from :mod:`nxd_optim`, on every backend."""

from neuronx_distributed.optimizer import zero_redundancy_optimizer
from nxd_optim import NeuronEPZero1Optimizer, NeuronZero1Optimizer

__all__ = ["NeuronEPZero1Optimizer", "NeuronZero1Optimizer", "zero_redundancy_optimizer"]
