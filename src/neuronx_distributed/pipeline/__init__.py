"""NxD's ``neuronx_distributed.pipeline``: :class:`nxd_pipeline.NxDPPModel`."""

from nxd_pipeline import NxDPPModel

__all__ = ["NxDPPModel"]
