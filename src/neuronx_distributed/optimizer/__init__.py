"""NxD's ``neuronx_distributed.optimizer``: ZeRO-1 from :mod:`nxd_optim`, on every backend."""

from nxd_optim import NeuronZero1Optimizer

__all__ = ["NeuronZero1Optimizer"]
