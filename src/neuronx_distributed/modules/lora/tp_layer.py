"""NxD's ``neuronx_distributed.modules.lora.tp_layer``: LoRA on tensor-parallel layers."""

from nxd_lora.tp_layers import LoraGQAQKVParallelLinear, LoraParallelLinear

__all__ = ["LoraGQAQKVParallelLinear", "LoraParallelLinear"]
