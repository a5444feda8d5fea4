"""NxD's ``neuronx_distributed.optimizer.zero_redundancy_optimizer``: ZeRO-1 and the EP-aware
ZeRO-1 (experts sharded over the expert data-parallel group) from :mod:`nxd_optim`."""

from __future__ import annotations

from nxd_optim import NeuronEPZero1Optimizer, NeuronZero1Optimizer

__all__ = ["NeuronEPZero1Optimizer", "NeuronZero1Optimizer"]
