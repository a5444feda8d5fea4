"""Inference tracing of tensor-parallel models: NxD's ``parallel_model_trace``,
``parallel_model_save`` and ``parallel_model_load``, portable.

    model = parallel_model_trace(get_model, example_inputs, tp_degree=2)  # -> (model, None)
    y = model(x)                                  # every rank runs; rank 0's output returned
    parallel_model_save(model, "traced/")         # tp_<r>.pt2 + manifest.json (+ safetensors)
    model.close()
    with parallel_model_load("traced/") as loaded:  # no model code needed
        y = loaded(x)

``tp_degree`` worker processes are started through PyTorch's elastic launcher (gloo on CPU,
NCCL on CUDA); each builds its shard with ``func()`` and captures it with ``torch.export``,
collectives included, one program per bucket. Where torch-neuronx is installed and the
device is XLA, each rank is compiled by ``torch_neuronx.trace`` instead (NxD's route; untested
here). See the package README for the file layout and the limits.
"""

from nxd_layers.trace._api import parallel_model_load, parallel_model_save, parallel_model_trace
from nxd_layers.trace._model import ParallelModel, TensorParallelModel
from nxd_layers.trace._options import ExportOptions
from nxd_layers.trace._pool import WorkerDiedError, WorkerError

TensorParallelNeuronModel = TensorParallelModel  # NxD's class name for the same thing

__all__ = [
    "ExportOptions",
    "ParallelModel",
    "TensorParallelModel",
    "TensorParallelNeuronModel",
    "WorkerDiedError",
    "WorkerError",
    "parallel_model_load",
    "parallel_model_save",
    "parallel_model_trace",
]
