"""NxD's ``neuronx_distributed.optimizer.zero_redundancy_optimizer``."""

from __future__ import annotations

from nxd_optim import NeuronZero1Optimizer

__all__ = ["NeuronEPZero1Optimizer", "NeuronZero1Optimizer"]


class NeuronEPZero1Optimizer(NeuronZero1Optimizer):
    """NxD's ZeRO-1 for models with expert parallelism, which shards expert parameters over the
    expert-data-parallel group and the others over the data-parallel group.

    At ``expert_model_parallel_size`` 1 the two groups are the same: this is
    :class:`NeuronZero1Optimizer`, with the same arguments. At EP > 1 nxd has no EP-aware
    ZeRO-1 yet: construction raises ``NotImplementedError`` naming the EP degree (as
    :class:`NeuronZero1Optimizer` does), and ``nxd_optim.NxDOptimizer`` without ZeRO-1 is the
    optimizer to use (it averages expert gradients over the expert-data-parallel group)."""
