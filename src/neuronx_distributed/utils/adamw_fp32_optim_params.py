"""NxD's ``neuronx_distributed.utils.adamw_fp32_optim_params``: AdamW with fp32 state."""

from nxd_optim import AdamW_FP32OptimParams, AdamWFP32OptimParams

__all__ = ["AdamWFP32OptimParams", "AdamW_FP32OptimParams"]
