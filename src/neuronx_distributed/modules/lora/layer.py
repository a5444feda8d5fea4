"""NxD's ``neuronx_distributed.modules.lora.layer``: LoRA on plain layers."""

from nxd_lora.layers import LoraConv2d, LoraEmbedding, LoraLayer, LoraLinear

__all__ = ["LoraConv2d", "LoraEmbedding", "LoraLayer", "LoraLinear"]
