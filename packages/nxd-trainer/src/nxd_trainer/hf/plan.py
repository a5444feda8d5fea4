"""Families by rule: any causal LM whose config declares transformers' tensor-parallel plan
(``base_model_tp_plan``), parallelised by mapping the plan's styles onto nxd's layers
(:mod:`nxd_trainer.hf._rules`), the family's own forwards kept.

    parallelizer = ParallelizersManager.parallelizer_for_model(model)  # e.g. gemma2
    model = parallelizer.parallelize(model)  # refuses what it would not reproduce exactly

Tensor parallelism, and pipeline parallelism where transformers also declares a pipeline plan
(``base_model_pp_plan``: the decoder layers are the stack the stages are cut from; stages are
captured by ``torch.export`` with every decoder layer kept as a call, so the family's own
layer forward, sharded by its tensor-parallel plan, runs in each stage). Sequence parallelism
where the model allows it exactly (:mod:`nxd_trainer.hf._sequence`). The K/V heads must
split over TP (no replication). MoE experts are kept whole on every TP rank at expert
parallelism 1; at ``expert_model_parallel_size > 1`` transformers' packed experts (Mixtral,
Qwen2-MoE, Qwen3-MoE) are sharded over the EP group, TP inside each expert
(:mod:`nxd_trainer.hf._experts`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

import nxd_state
from nxd_trainer.hf._experts import check_experts, swap_experts
from nxd_trainer.hf._rules import (
    UnsupportedModelError,
    _head_dim,
    inspect_model,
    module_list_at,
    resolve_plan,
)
from nxd_trainer.hf._sequence import sequence_parallel_modules
from nxd_trainer.hf._swap import Layout, swap_layers
from nxd_trainer.hf.parallelizer import Parallelizer
from nxd_trainer.hf.spec import ModelSpec

__all__ = ["PlanParallelizer", "pipeline_layers", "plan_parallelizer", "text_tp_plan"]

_CLASSES: dict[str, type[PlanParallelizer]] = {}

PIPELINE_REFUSED = {
    "deepseek_v4": (
        "its captured pipeline stages specialise on the sequence length (its compressed "
        "attention's blocks of 4 tokens: a guard on input_ids.size(1) // 4 fails at other "
        "lengths); pipeline parallelism is refused for it"
    ),
}
"""Families whose declared pipeline plan was tried (a sweep of every family with one, at PP=2)
and does not work: refused by name."""


def text_tp_plan(model_type: str, config: Any = None) -> dict[str, str]:
    """The tensor-parallel plan transformers declares for ``model_type`` (``config``'s when
    given); :class:`UnsupportedModelError` when there is none, or when the family is a
    multimodal wrapper (its text model is the one to parallelise)."""
    if config is None:
        from transformers import CONFIG_MAPPING  # imports this family's config module only

        if model_type not in CONFIG_MAPPING:
            raise UnsupportedModelError(model_type, "transformers has no config for it")
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception as error:
            raise UnsupportedModelError(
                model_type, f"its default config does not build ({type(error).__name__})"
            ) from None
    try:
        text = config.get_text_config()
    except ValueError as error:
        raise UnsupportedModelError(model_type, f"no single text config ({error})") from None
    if text is not config and text.model_type != config.model_type:
        raise UnsupportedModelError(
            model_type,
            f"a multimodal model: parallelise its text model ({text.model_type!r}) instead",
        )
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise UnsupportedModelError(
            model_type,
            "transformers declares no tensor-parallel plan (base_model_tp_plan) for it, and "
            "it is not a registered family (ParallelizersManager.register)",
        )
    return dict(plan)


class PlanParallelizer(Parallelizer):
    """A family parallelised by its declared plan; subclasses (one per model type, from
    :func:`plan_parallelizer`) set :attr:`spec` and :attr:`tp_plan`."""

    tp_plan: ClassVar[dict[str, str]]

    @classmethod
    def inspect(
        cls, model: nn.Module, *, sequence_parallel: bool = False, gather_output: bool = False
    ) -> None:
        family = cls.spec.model_type
        plan = resolve_plan(model, family, text_tp_plan(family, model.config))
        tp = nxd_state.get_tensor_model_parallel_size()
        inspect_model(model, family, plan, tp, gather_output=gather_output)
        if sequence_parallel:
            sequence_parallel_modules(model, family, plan, cls.spec.layers)
        ep = nxd_state.get_expert_model_parallel_size()
        if ep > 1:
            check_experts(model, family, ep, tp)

    @classmethod
    def _check_pipeline(cls, model: nn.Module, input_names: Any) -> None:
        if not cls.spec.supports_pipeline_parallel:
            raise UnsupportedModelError(
                cls.spec.model_type,
                "transformers declares no pipeline plan (base_model_pp_plan) naming its "
                "decoder layers, the stack pipeline stages are cut from",
            )
        known = PIPELINE_REFUSED.get(cls.spec.model_type)
        if known is not None:
            raise UnsupportedModelError(cls.spec.model_type, known)
        if getattr(getattr(model, "config", None), "output_router_logits", False):
            raise UnsupportedModelError(
                cls.spec.model_type,
                "output_router_logits=True at PP > 1: transformers sums the auxiliary loss over "
                "router logits collected from every layer, but each stage holds only its own "
                "layers; set output_router_logits=False or use PP=1",
            )
        check_pipeline_stack(model, cls.spec.model_type, cls.spec.layers)
        super()._check_pipeline(model, input_names)

    @classmethod
    def layout(cls, config: Any, tp: int, kv_size_multiplier: int | None) -> Layout:
        if kv_size_multiplier not in (None, 1):
            raise ValueError(
                f"kv_size_multiplier={kv_size_multiplier}: replicated KV heads are the "
                f"Llama-family path's only ({cls.spec.model_type} is parallelised by its plan)"
            )
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        return Layout(tp, heads, kv, int(_head_dim(config) or 1), 1, int(config.vocab_size))

    @classmethod
    def _parallelize(
        cls,
        model: nn.Module,
        device: torch.device | None = None,
        parallelize_embeddings: bool = True,
        sequence_parallel_enabled: bool = False,
        should_parallelize_layer_predicate_func: Any = None,
        **parallel_layer_specific_kwargs: Any,
    ) -> nn.Module:
        del device
        cls.check_model(model)
        family = cls.spec.model_type
        if should_parallelize_layer_predicate_func is not None:
            raise ValueError(
                f"{family}: should_parallelize_layer_predicate_func is the Llama-family "
                f"path's (decoder layers); the tensor-parallel plan swaps every block it names"
            )
        gather_output = bool(parallel_layer_specific_kwargs.get("gather_output", False))
        plan = resolve_plan(model, family, text_tp_plan(family, model.config))
        tp = nxd_state.get_tensor_model_parallel_size()
        inspect_model(model, family, plan, tp, gather_output=gather_output)
        layout = cls.layout(
            model.config, tp, parallel_layer_specific_kwargs.get("kv_size_multiplier")
        )
        norms = None
        if sequence_parallel_enabled:
            norms = sequence_parallel_modules(model, family, plan, cls.spec.layers)
        spec = ModelSpec(
            model_type=family, layers=cls.spec.layers, embed_tokens=plan.embed, lm_head=plan.lm_head
        )
        model.__dict__["_nxd_plan"] = swap_layers(
            model,
            spec,
            layout,
            sequence_parallel=sequence_parallel_enabled,
            parallelize_embeddings=parallelize_embeddings,
            blocks=plan.blocks,
            gather_output=gather_output,
            sequence_parallel_norms=norms,
        )
        if nxd_state.get_expert_model_parallel_size() > 1:
            fill = model.__dict__["_nxd_plan"]
            swap_experts(model, family, fill.sources)
            fill.index(model)
        return model


def pipeline_layers(model_type: str, config: Any = None) -> str | None:
    """The path of the decoder-layer stack (``"model.layers"``, ``"gpt_neox.layers"``) when
    transformers declares a pipeline plan for ``model_type`` (``base_model_pp_plan`` naming
    ``layers``, relative to the causal LM's ``base_model_prefix``); None when it declares none."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config is None:
        if model_type not in CONFIG_MAPPING:
            return None
        config = CONFIG_MAPPING[model_type]  # the plan is a class attribute
    if "layers" not in (getattr(config, "base_model_pp_plan", None) or {}):
        return None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    causal_lm = getattr(transformers, name, None) if isinstance(name, str) else None
    prefix = getattr(causal_lm, "base_model_prefix", None)
    return f"{prefix}.layers" if isinstance(prefix, str) and prefix else None


def check_pipeline_stack(model: nn.Module, family: str, path: str) -> None:
    """The pipeline plan's ``layers`` is an ``nn.ModuleList`` at ``path`` of ``model``, else an
    :class:`UnsupportedModelError` (a plan naming a stack the model does not have)."""
    if module_list_at(model, path) is None:
        raise UnsupportedModelError(
            family,
            f"its pipeline plan (base_model_pp_plan) names 'layers', but the model has no "
            f"module list {path!r} to cut into pipeline stages",
        )


def plan_parallelizer(model_type: str, config: Any = None) -> type[PlanParallelizer]:
    """The :class:`PlanParallelizer` of ``model_type`` (its plan must exist: see
    :func:`text_tp_plan`); pipeline parallelism where :func:`pipeline_layers` finds the
    family's pipeline plan."""
    plan = text_tp_plan(model_type, config)
    if model_type not in _CLASSES:
        layers = pipeline_layers(model_type, config)
        spec = ModelSpec(
            model_type=model_type,
            layers=layers or "model.layers",
            supports_sequence_parallel=True,  # where the model passes the rules (_sequence)
            supports_pipeline_parallel=layers is not None,
        )
        name = "".join(p.capitalize() for p in model_type.replace("-", "_").split("_"))
        _CLASSES[model_type] = type(
            f"{name}PlanParallelizer", (PlanParallelizer,), {"spec": spec, "tp_plan": plan}
        )
    return _CLASSES[model_type]
