"""NxD's ``neuronx_distributed.modules.lora.model``."""

from nxd_lora.model import LoRAModel, LoraModel

__all__ = ["LoRAModel", "LoraModel"]
