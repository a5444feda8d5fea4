"""NxD's ``neuronx_distributed.parallel_layers.loss_functions``."""

from nxd_layers.loss_functions import from_parallel_logits_to_logprobs, parallel_cross_entropy

__all__ = ["from_parallel_logits_to_logprobs", "parallel_cross_entropy"]
