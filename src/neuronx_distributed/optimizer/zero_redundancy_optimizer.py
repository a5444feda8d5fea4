"""NxD's ``neuronx_distributed.optimizer.zero_redundancy_optimizer``."""

from __future__ import annotations

from typing import Any

from nxd_optim import NeuronZero1Optimizer

__all__ = ["NeuronEPZero1Optimizer", "NeuronZero1Optimizer"]


class NeuronEPZero1Optimizer(NeuronZero1Optimizer):
    """NxD's ZeRO-1 for models with expert parallelism, which shards expert parameters over the
    expert-data-parallel group and the others over the data-parallel group. nxd runs at
    ``expert_parallel_size`` 1 only (``initialize_model_parallel`` refuses more), where the two
    groups are the same: this is :class:`NeuronZero1Optimizer`, with the same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import nxd_state

        if nxd_state.model_parallel_is_initialized():
            size = nxd_state.get_expert_model_parallel_size()
            if size != 1:  # pragma: no cover - initialize_model_parallel refuses EP > 1
                raise NotImplementedError(
                    f"NeuronEPZero1Optimizer: expert_parallel_size={size}; nxd supports 1 only"
                )
        super().__init__(*args, **kwargs)
