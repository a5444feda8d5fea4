"""Which parallel parameter stands for which original one: ``id(original) -> parallel``.

:func:`original_parameter_ids` is taken before parallelising, :func:`parameter_mapping` after;
:func:`nxd_trainer.hf.optimizer_for_mp` moves an optimizer built over the original parameters
onto the parallel ones with it. The names come from the family's parallelizer (the registry),
so this module sits above :mod:`nxd_trainer.hf.manager`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from nxd_trainer.hf.manager import ParallelizersManager

__all__ = ["original_parameter_ids", "parameter_mapping"]


def original_parameter_ids(model: nn.Module) -> dict[str, int]:
    """``name -> id(parameter)`` of a model before parallelisation (every tied name)."""
    return {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}


def parameter_mapping(
    original_ids: Mapping[str, int], parallel_model: nn.Module
) -> dict[int, nn.Parameter]:
    """``id(original parameter) -> parallel parameter`` for
    :func:`nxd_trainer.hf.optimizer_for_mp`, from :func:`original_parameter_ids` taken before
    parallelising and the parallel model (an NxDPPModel: this rank's stages). The GQA
    projection's ``weight_q/k/v`` stand for the original ``q_proj/k_proj/v_proj`` weights; a
    fused ``weight_qkv`` for all three."""
    named = getattr(parallel_model, "local_named_parameters", None)
    pairs = list(named()) if callable(named) else list(parallel_model.named_parameters())
    parallelizer = ParallelizersManager.parallelizer_for_model(_config_holder(parallel_model))
    out: dict[int, nn.Parameter] = {}
    for name, param in pairs:
        for hf_name in parallelizer.hf_names(name):
            original = original_ids.get(hf_name)
            if original is not None:
                out[original] = param
    return out


def _config_holder(model: nn.Module) -> Any:
    """The model (or, in pipeline stages, the first submodule) with ``config.model_type``."""
    for sub in model.modules():
        if hasattr(sub, "config") and hasattr(sub.config, "model_type"):
            return sub
    raise TypeError(f"{type(model).__name__} holds no Hugging Face model (no config.model_type)")
