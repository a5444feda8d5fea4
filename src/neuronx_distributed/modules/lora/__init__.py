"""NxD's ``neuronx_distributed.modules.lora``: LoRA from :mod:`nxd_lora`."""

from __future__ import annotations

from torch import nn

import nxd_lora
from nxd_lora import (
    LoraConfig,
    LoraConv2d,
    LoraEmbedding,
    LoraGQAQKVParallelLinear,
    LoraLayer,
    LoraLinear,
    LoRAModel,
    LoraModel,
    LoraParallelLinear,
)

__all__ = [
    "LoRAModel",
    "LoraConfig",
    "LoraConv2d",
    "LoraEmbedding",
    "LoraGQAQKVParallelLinear",
    "LoraLayer",
    "LoraLinear",
    "LoraModel",
    "LoraParallelLinear",
    "get_lora_model",
]


def get_lora_model(model: nn.Module, lora_config: LoraConfig | None) -> nn.Module:
    """NxD's ``get_lora_model``: ``model`` with LoRA whenever a ``lora_config`` is given
    (its ``enable_lora`` is not consulted, as in NxD); an ``NxDModel`` keeps its wrapper
    and gets LoRA on the module it wraps, as in NxD."""
    if not nxd_lora.lora_requested(lora_config, "get_lora_model"):
        return model
    assert lora_config is not None
    from nxd_trainer import NxDModel

    if isinstance(model, NxDModel):
        if model.pp_enabled:
            raise ValueError(
                "get_lora_model: LoRA on a pipeline-parallel NxDModel is not supported; pass "
                "lora_config to neuronx_distributed_config at pipeline_parallel_size=1"
            )
        model.module = nxd_lora.get_lora_model(model.module, lora_config)
        return model
    return nxd_lora.get_lora_model(model, lora_config)
