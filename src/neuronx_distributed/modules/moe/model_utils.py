"""NxD's ``neuronx_distributed.modules.moe.model_utils``."""

from nxd_layers.moe.model_utils import ACT2FN, MoESequenceParallelMode

__all__ = ["ACT2FN", "MoESequenceParallelMode"]
