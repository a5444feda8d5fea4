"""NxD's ``neuronx_distributed.modules.qkv_linear`` (and the KV-group helpers NxD's GQA tests
reach through it)."""

from nxd_layers.qkv_linear import GQAQKVColumnParallelLinear, get_kv_size_multiplier
from nxd_state import destroy_kv_group, get_kv_shared_group, initialize_kv_group

__all__ = [
    "GQAQKVColumnParallelLinear",
    "destroy_kv_group",
    "get_kv_shared_group",
    "get_kv_size_multiplier",
    "initialize_kv_group",
]
