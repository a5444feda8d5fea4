"""NxD's ``neuronx_distributed.modules.lora``: LoRA from :mod:`nxd_lora`."""

from nxd_lora import (
    LoraConfig,
    LoraConv2d,
    LoraEmbedding,
    LoraGQAQKVParallelLinear,
    LoraLayer,
    LoraLinear,
    LoRAModel,
    LoraModel,
    LoraParallelLinear,
    get_lora_model,
)

__all__ = [
    "LoRAModel",
    "LoraConfig",
    "LoraConv2d",
    "LoraEmbedding",
    "LoraGQAQKVParallelLinear",
    "LoraLayer",
    "LoraLinear",
    "LoraModel",
    "LoraParallelLinear",
    "get_lora_model",
]
