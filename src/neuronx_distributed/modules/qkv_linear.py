"""NxD's ``neuronx_distributed.modules.qkv_linear``."""

from nxd_layers.qkv_linear import GQAQKVColumnParallelLinear, get_kv_size_multiplier

__all__ = ["GQAQKVColumnParallelLinear", "get_kv_size_multiplier"]
