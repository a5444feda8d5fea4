"""NxD's ``neuronx_distributed.pipeline``: :class:`nxd_pipeline.NxDPPModel` and its modules."""

from neuronx_distributed.pipeline import comm, manual_pipe_stage, model
from nxd_pipeline import NxDPPModel

__all__ = ["NxDPPModel", "comm", "manual_pipe_stage", "model"]
