"""NxD's ``neuronx_distributed.modules.lora.config``."""

from nxd_lora.config import LoraConfig

__all__ = ["LoraConfig"]
