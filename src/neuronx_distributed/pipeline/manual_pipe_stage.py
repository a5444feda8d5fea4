"""NxD's ``neuronx_distributed.pipeline.manual_pipe_stage``."""

from nxd_pipeline import PipelineStageModule

__all__ = ["PipelineStageModule"]
