"""NxD's ``neuronx_distributed.parallel_layers.random``: :mod:`nxd_state.rng` and NxD's names."""

from nxd_state.rng import *  # noqa: F403
from nxd_state.rng import RNGStatesTracker, get_rng_tracker, model_parallel_manual_seed
from nxd_state.rng import __all__ as _rng_all

# NxD's XLA spellings and Megatron's CUDA ones: one device-agnostic tracker behind all of them.
XLARNGStatesTracker = RNGStatesTracker
CudaRNGStatesTracker = RNGStatesTracker
get_xla_rng_tracker = get_rng_tracker
get_cuda_rng_tracker = get_rng_tracker
model_parallel_xla_manual_seed = model_parallel_manual_seed
model_parallel_cuda_manual_seed = model_parallel_manual_seed

__all__ = [
    *_rng_all,
    "CudaRNGStatesTracker",
    "XLARNGStatesTracker",
    "get_cuda_rng_tracker",
    "get_xla_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_xla_manual_seed",
]
