"""NxD's ``neuronx_distributed.modules.moe.model``."""

from nxd_layers.moe.model import MoE

__all__ = ["MoE"]
