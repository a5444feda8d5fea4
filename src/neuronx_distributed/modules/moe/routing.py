"""NxD's ``neuronx_distributed.modules.moe.routing``."""

from nxd_layers.moe.routing import RouterBase, RouterSinkhorn, RouterTopK

__all__ = ["RouterBase", "RouterSinkhorn", "RouterTopK"]
