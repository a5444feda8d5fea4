"""NxD's ``neuronx_distributed.trace``: per-rank tensor-parallel inference programs from
:mod:`nxd_layers.trace` (``torch.export`` on CPU/CUDA, ``torch_neuronx.trace`` where installed)."""

from nxd_layers.trace import (
    ParallelModel,
    TensorParallelModel,
    TensorParallelNeuronModel,
    parallel_model_load,
    parallel_model_save,
    parallel_model_trace,
)

__all__ = [
    "ParallelModel",
    "TensorParallelModel",
    "TensorParallelNeuronModel",
    "parallel_model_load",
    "parallel_model_save",
    "parallel_model_trace",
]
