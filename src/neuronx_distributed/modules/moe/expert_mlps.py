"""NxD's ``neuronx_distributed.modules.moe.expert_mlps``."""

from nxd_layers.moe.experts import ExpertMLPs, ExpertMLPsCapacityFactor

__all__ = ["ExpertMLPs", "ExpertMLPsCapacityFactor"]
