"""NxD's ``neuronx_distributed.pipeline.model``."""

from nxd_pipeline import NxDPPModel

__all__ = ["NxDPPModel"]
