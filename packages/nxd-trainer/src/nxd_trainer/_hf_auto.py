"""``initialize_parallel_model`` on a Hugging Face model: parallelised by :mod:`nxd_trainer.hf`.

At ``tensor_parallel_size > 1`` a model of a supported family that ``model_fn`` returns with
plain ``nn.Linear`` layers would otherwise be replicated on every TP rank. Unless the config
says ``parallelize_hf_models=False``, its layers are swapped for parallel ones (sequence
parallel with ``sequence_parallel``), then filled like any meta-device model. Supported: the
registered (Llama-family) path, and every family transformers declares a tensor-parallel plan
for (:mod:`nxd_trainer.hf.plan`; pipeline stages where it also declares a pipeline plan),
refused with the inspection's error where the plan would not reproduce the model exactly. The MoE
families (Mixtral, Qwen2-MoE, Qwen3-MoE) are parallelised too, at TP > 1 or
``expert_parallel_size > 1`` (their experts sharded over EP, :mod:`nxd_trainer.hf._experts`);
at EP > 1 only they are (a dense model has no experts to shard). The new layers are filled by
the ``param_init_fn`` the trainer hands to the materialisation (PP = 1) or to ``NxDPPModel``
(PP > 1), which here reads each rank's part of the model's own weights, or of the folder a
model built under ``lazy_load_for_parallelism`` came from; tensors without a source (a
model built on ``meta`` by ``meta_device_init``) go to the config's ``param_init_fn``.

At ``context_parallel_size > 1`` (any TP) the model must be such a model, and its attention
modules are marked to attend over the whole sequence split across the CP group
(:mod:`nxd_trainer._context_parallel`).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from nxd_trainer._model_info import ModelInfo
from nxd_trainer.config import NxDConfig

__all__ = ["prepare_hf_model"]

logger = logging.getLogger(__name__)


def _already_parallel(model: nn.Module) -> bool:
    from nxd_layers import BaseParallelLinear, ParallelEmbedding

    return any(isinstance(m, (BaseParallelLinear, ParallelEmbedding)) for m in model.modules())


def prepare_hf_model(config: NxDConfig, model: nn.Module, info: ModelInfo) -> Any:
    """Swap ``model``'s layers when the rules above say so; returns the fill plan (its
    ``init_fn`` is the param_init_fn to use, ``leaves`` the pipeline's extra leaf classes),
    or None when the model is left as it is."""
    if config.context_parallel_size > 1:
        from nxd_trainer._context_parallel import (
            check_context_parallel_model,
            enable_context_parallel,
        )

        parallelizer = check_context_parallel_model(model, config)
        plan = _prepare_tp(config, model, info)
        pipelined = config.pipeline_parallel_size > 1
        enable_context_parallel(
            model, parallelizer, config.context_parallel_algorithm, pipelined=pipelined
        )
        return plan
    return _prepare_tp(config, model, info)


def _prepare_tp(config: NxDConfig, model: nn.Module, info: ModelInfo) -> Any:
    tp, ep = config.tensor_parallel_size, config.expert_parallel_size
    if not (config.parallelize_hf_models and info.is_hf and (tp > 1 or ep > 1)):
        return None
    if _already_parallel(model):
        return None
    from nxd_trainer.hf import ParallelizersManager, UnsupportedModelError
    from nxd_trainer.hf._experts import MOE_FAMILIES
    from nxd_trainer.hf._sources import FolderStore
    from nxd_trainer.hf._swap import make_meta
    from nxd_trainer.hf.parallelizer import LAZY_FOLDER

    model_type = getattr(model.config, "model_type", None)
    instead = (
        "build the model from nxd's parallel layers, or set parallelize_hf_models=False to "
        "use it replicated as returned"
    )
    if ep > 1 and model_type not in MOE_FAMILIES:  # only these have experts to shard
        raise ValueError(
            f"expert_parallel_size={ep} with a Hugging Face {info.class_name} (model_type "
            f"{model_type!r}): nxd shards the experts of {list(MOE_FAMILIES)}; {instead}"
        )
    try:  # a registered family, or one transformers declares a tensor-parallel plan for
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
    except UnsupportedModelError as error:
        raise ValueError(
            f"tensor_parallel_size={tp} with a Hugging Face {info.class_name}: {error}; {instead}"
        ) from None
    if config.pipeline_parallel_size > 1 and not parallelizer.spec.supports_pipeline_parallel:
        raise ValueError(
            f"pipeline_parallel_size={config.pipeline_parallel_size} with a Hugging Face "
            f"{info.class_name}: transformers declares no pipeline plan (base_model_pp_plan) "
            f"for {model_type!r}, so nxd does not know where to cut its stages; {instead}"
        )

    if config.pad_model:
        raise ValueError(
            "pad_model with a Hugging Face model that nxd parallelises: its heads must divide "
            "tensor_parallel_size (pad_model pads models built from TP layers)"
        )
    parallelizer._parallelize(model, sequence_parallel_enabled=config.sequence_parallel)
    plan = model.__dict__.pop("_nxd_plan")
    folder = model.__dict__.get(LAZY_FOLDER)
    if folder is not None:
        plan.folder = FolderStore(folder)
        make_meta(model, buffers=False)
    if config.pipeline_parallel_size > 1:
        make_meta(model, buffers=True)
        plan.leaves = parallelizer.pipeline_leaves(model)
    logger.info("parallelised the Hugging Face %s with %s", info.class_name, parallelizer.__name__)
    return plan
