"""NxD's ``neuronx_distributed.parallel_layers.pad``."""

from nxd_layers.pad import get_number_of_extra_heads, pad_model

__all__ = ["get_number_of_extra_heads", "pad_model"]
