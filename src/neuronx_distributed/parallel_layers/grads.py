"""NxD's ``neuronx_distributed.parallel_layers.grads``."""

from nxd_layers.grads import (
    allreduce_sequence_parallel_gradients,
    bucket_allreduce_gradients,
    clip_grad_norm,
    clip_grads_with_norm,
    get_grad_norm,
    param_is_not_shared,
)

__all__ = [
    "allreduce_sequence_parallel_gradients",
    "bucket_allreduce_gradients",
    "clip_grad_norm",
    "clip_grads_with_norm",
    "get_grad_norm",
    "param_is_not_shared",
]
