"""Ranks fork from a forkserver that already imported NxD's import paths (and what they pull in),
so each rank of the compat suite starts warm."""

from nxd_state.testing import add_preload

add_preload(
    "neuronx_distributed.parallel_layers",
    "neuronx_distributed.modules.qkv_linear",
    "neuronx_distributed.modules.lora",
    "neuronx_distributed.optimizer",
    "neuronx_distributed.pipeline",
    "neuronx_distributed.overrides.transformer_overrides",
    "neuronx_distributed.utils.logger",
)
