"""NxD's ``neuronx_distributed.parallel_layers.grads``."""

from nxd_layers.grads import allreduce_sequence_parallel_gradients, clip_grad_norm, get_grad_norm

__all__ = ["allreduce_sequence_parallel_gradients", "clip_grad_norm", "get_grad_norm"]
