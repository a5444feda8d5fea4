"""``initialize_parallel_model`` and ``initialize_parallel_optimizer``: NxD's two wrappers.

The model is built in this order (each step explained where it happens):

1. ``model_fn(*args, **kwargs)``, its parameters on the meta device with
   ``meta_device_init`` (and its buffers too with ``include_buffers``), in waves of
   ``sequential_move_factor`` local ranks (host memory); at TP > 1 a Hugging Face model of a
   supported family gets nxd's parallel layers (:mod:`nxd_trainer._hf_auto`), filled below;
2. PP > 1: :class:`nxd_pipeline.NxDPPModel` traces it, keeps this rank's stages and
   materialises only their parameters (``param_init_fn``); PP = 1: the meta parameters are
   materialised, or the eager model is moved, onto this rank's device;
3. sequence parallelism is checked against the model's layers;
4. ``pad_model`` pads attention heads to a multiple of TP (a TP collective, so after the
   waves), before LoRA so that adapters get the padded shapes (NxD pads after LoRA);
5. LoRA (``nxd_lora.LoRAModel``) wraps the model and freezes the base (``load_lora_from_ckpt``:
   the adapter of a ``save_checkpoint`` tag, or of an nxd-lora folder, is loaded);
6. activation checkpointing patches the chosen modules' forwards (names unchanged);
7. :class:`~nxd_trainer.NxDModel` wraps the result.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

import nxd_state
from nxd_trainer._hf_auto import prepare_hf_model
from nxd_trainer._lora import wrap_lora
from nxd_trainer._materialize import as_module_init, build_in_waves, materialize_meta_module
from nxd_trainer._model_info import ModelInfo, resolve_classes
from nxd_trainer.activation_checkpoint import apply_activation_checkpointing
from nxd_trainer.config import NxDConfig, initialize_model_parallel
from nxd_trainer.model import NxDModel, claim_dp_reduction

if TYPE_CHECKING:
    from nxd_optim import NxDOptimizer
    from nxd_pipeline import PipelineOptions

__all__ = [
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "optimizer_param_names",
]

logger = logging.getLogger(__name__)

# Optimizer -> names of its parameters (in param-group order), for checkpoints by name.
_PARAM_NAMES: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[str | None]] = (
    weakref.WeakKeyDictionary()
)


def _model_parallel_state(config: NxDConfig) -> nxd_state.ParallelState:
    """The current parallel state, created from ``config`` if there is none yet."""
    if nxd_state.model_parallel_is_initialized():
        state = nxd_state.get_parallel_state()
        if (
            state.tensor_parallel_size,
            state.pipeline_parallel_size,
            state.expert_model_parallel_size,
        ) != (
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.expert_parallel_size,
        ):
            raise ValueError(
                f"nxd_config says tensor_parallel_size={config.tensor_parallel_size}, "
                f"pipeline_parallel_size={config.pipeline_parallel_size}, expert_parallel_size="
                f"{config.expert_parallel_size}, but model parallelism is initialised with "
                f"{state.tensor_parallel_size}, {state.pipeline_parallel_size} and "
                f"{state.expert_model_parallel_size}"
            )
        return state
    return initialize_model_parallel(config)


# Building the model ----------------------------------------------------------------------
def _call_model_fn(
    config: NxDConfig,
    model_fn: Callable[..., Any],
    include_buffers: bool,
    args: tuple,
    kwargs: dict,
) -> nn.Module:
    if config.model_init_config.meta_device_init:
        from nxd_layers import init_on_device

        with init_on_device(torch.device("meta"), include_buffers=include_buffers):
            model = model_fn(*args, **kwargs)
    else:
        model = model_fn(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model_fn must return a torch.nn.Module, got {type(model).__name__} from "
            f"{getattr(model_fn, '__qualname__', model_fn)!r}"
        )
    return model


def _pipeline_options(
    config: NxDConfig,
    model: nn.Module,
    info: ModelInfo,
    init: Callable[[nn.Module], None] | None,
    device: torch.device,
    extra_leaves: list[type] | None = None,
) -> PipelineOptions:
    """NxDPPModel's options: ``pipeline_config``'s, with what needs the model resolved."""
    pipe = config.pipeline_config
    assert pipe is not None  # NxDConfig requires it at PP > 1
    tracer = pipe.tracer_cls if pipe.tracer_cls is not None else ("hf" if info.is_hf else None)
    if tracer == "hf" and not pipe.input_names:
        raise ValueError(
            f"pipeline_config['input_names'] is required to trace the Hugging Face model "
            f"{info.class_name} (e.g. ['input_ids', 'attention_mask', 'labels'])"
        )
    layer = pipe.transformer_layer_cls
    if isinstance(layer, str):
        layer = resolve_classes("pipeline_config['transformer_layer_cls']", [layer], model)[0]
    leaves = resolve_classes(
        "pipeline_config['leaf_module_cls']", pipe.leaf_module_cls or [], model
    )
    if extra_leaves:  # a parallelised HF model: its layer, parallel layers and loss
        leaves = tuple(dict.fromkeys([*leaves, *extra_leaves]))
    if pipe.deallocate_pipeline_outputs:
        logger.info("deallocate_pipeline_outputs: nxd frees sent activations already")
    # The DP reduction happens once per step: here only when the config says no optimizer
    # wrapper will do it (use_zero1_optimizer is NxDPPModel's switch that skips its own).
    pipeline_reduces = pipe.use_optimizer_wrapper is False and not (
        config.optimizer_config.zero_one_enabled
    )
    names = list(pipe.input_names) if pipe.input_names else None
    if config.context_parallel_size > 1:  # the inputs NxDModel hands over after its split
        from nxd_trainer._context_parallel import pipeline_input_names

        names = pipeline_input_names(names)
    return pipe.options(
        transformer_layer_cls=layer,
        leaf_module_cls=leaves,
        input_names=names,
        tracer_cls=tracer,
        param_init_fn=init,
        use_zero1_optimizer=not pipeline_reduces,
        device=device,
    )


def _build_local(
    config: NxDConfig,
    model_fn: Callable[..., Any],
    include_buffers: bool,
    args: tuple,
    kwargs: dict,
) -> tuple[nn.Module, nn.Module, ModelInfo]:
    """Steps 1-2: (local model, the original model, its info)."""
    device = nxd_state.current_device()
    init = as_module_init(config.param_init_fn, device)
    model = _call_model_fn(config, model_fn, include_buffers, args, kwargs)
    info = ModelInfo.of(model)
    plan = prepare_hf_model(config, model, info)
    if plan is not None:
        init = plan.init_fn(fallback=init)
    try:
        if config.pipeline_parallel_size > 1:
            from nxd_pipeline import NxDPPModel

            leaves = plan.leaves if plan is not None else None
            options = _pipeline_options(config, model, info, init, device, leaves)
            pipelined = NxDPPModel(model, options=options)
            if plan is not None:
                plan.captured()
            return pipelined, model, info
        if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
            if init is None:
                raise ValueError(
                    "model_fn returned a model with meta-device tensors but no param_init_fn "
                    "is set (model_init_config['param_init_fn'])"
                )
            # NxD calls param_init_fn on every module (a parent may replace a child holding
            # meta buffers); a parallelised HF model's fill plan only on those it must fill.
            materialize_meta_module(model, device, init, every_module=plan is None)
        return nxd_state.move_model_to_device(model, device), model, info
    finally:
        if plan is not None:  # drop the references to the original full tensors
            plan.memory.tensors.clear()


def _check_sequence_parallel(config: NxDConfig, original: nn.Module) -> None:
    layers = [
        name
        for name, module in original.named_modules()
        if getattr(module, "sequence_parallel_enabled", False)
    ]
    if config.sequence_parallel and not layers:
        raise ValueError(
            "sequence_parallel=True but no layer of the model was built with "
            "sequence_parallel_enabled=True: build the TP layers with it (the config alone "
            "does not change the model)"
        )
    if layers and not config.sequence_parallel:
        raise ValueError(
            f"layers {layers[:4]} run with sequence_parallel_enabled=True but the config has "
            f"sequence_parallel=False: set sequence_parallel=True"
        )


def _pad(config: NxDConfig, model: nn.Module, info: ModelInfo) -> None:
    """NxD's ``pad_model`` on the attention modules (classes named ``*Attention*`` holding TP
    linears); a model without such classes is padded throughout, as NxD does."""
    from nxd_layers import ColumnParallelLinear, RowParallelLinear, pad_model

    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(
            f"pad_model=True needs a Hugging Face-style model with config.num_attention_heads; "
            f"{info.class_name} has none"
        )
    parallel = (ColumnParallelLinear, RowParallelLinear)
    attention = {
        type(m)
        for m in model.modules()
        if "Attention" in type(m).__name__ and any(isinstance(c, parallel) for c in m.children())
    }
    aligned = config.pad_model == "head_aligned"
    pad_model(
        model,
        config.tensor_parallel_size,
        heads,
        wrapped_classes=tuple(attention),
        head_aligned=aligned,
    )


def _checkpoint_classes(config: NxDConfig, original: nn.Module, info: ModelInfo) -> tuple:
    setting = config.activation_checkpoint_config
    if setting != "full":
        classes = tuple(setting) if isinstance(setting, (list, tuple)) else (setting,)
    else:
        pipe = config.pipeline_config
        layer = pipe.transformer_layer_cls if pipe is not None else None
        if layer is not None:
            classes = resolve_classes("pipeline_config['transformer_layer_cls']", [layer], original)
        elif info.layer_classes:
            classes = info.layer_classes
        else:
            raise ValueError(
                "activation_checkpoint_config='full' recomputes every transformer layer: give "
                "pipeline_config['transformer_layer_cls'] (a Hugging Face model's layers are "
                "found from its _no_split_modules), or pass the layer classes themselves"
            )
    if not any(isinstance(m, classes) for m in original.modules()):
        names = [c.__name__ for c in classes]
        raise ValueError(f"activation_checkpoint_config: the model has no module of {names}")
    return classes


def _check_pipeline_reachable(stages: Iterable[nn.Module], names: list[str]) -> None:
    """Each checkpointed module must run as a module call in its stage's graph (or inside
    one); a module whose operations were traced into the graph would never be recomputed."""
    calls: set[str] = set()
    for stage in stages:
        if isinstance(stage, fx.GraphModule):
            calls.update(str(n.target) for n in stage.graph.nodes if n.op == "call_module")
    inlined = [
        name for name in names if not any(name == c or name.startswith(c + ".") for c in calls)
    ]
    if inlined:
        raise ValueError(
            f"activation checkpointing cannot apply to {inlined[:4]}: the pipeline traced "
            f"through them (their operations are in the stage graph, not a module call). Add "
            f"their class to pipeline_config['leaf_module_cls'] (both routes keep it as a call "
            f"where they can; the torch.export route warned about any it had to inline)"
        )


def initialize_parallel_model(
    nxd_config: Mapping[str, Any] | NxDConfig,
    model_fn: Callable[..., nn.Module],
    include_buffers: bool = False,
    *model_args: Any,
    **model_kwargs: Any,
) -> NxDModel:
    """NxD's model wrapper: build ``model_fn(*model_args, **model_kwargs)`` with every option
    of ``nxd_config`` applied, on this rank's device; returns an :class:`NxDModel`.

    ``include_buffers`` (NxD's third parameter, positional in NxD's examples): with
    ``meta_device_init``, buffers are created on the meta device too (``param_init_fn`` must
    then set them); by default only parameters are, and buffers keep the values ``model_fn``
    computed. Without ``meta_device_init`` it changes nothing. Arguments for ``model_fn`` come
    after it: ``initialize_parallel_model(cfg, get_model, False, model_config)``.

    ``model_fn`` must not communicate (ranks build it in waves).
    """
    config = NxDConfig.from_nxd(nxd_config)
    if not callable(model_fn):
        raise TypeError(f"model_fn must be callable, got {type(model_fn).__name__}")
    if not isinstance(include_buffers, bool):
        raise TypeError(
            f"initialize_parallel_model(nxd_config, model_fn, include_buffers, *model_args, "
            f"**model_kwargs): include_buffers must be a bool, got "
            f"{type(include_buffers).__name__} {include_buffers!r}; pass model_fn's arguments "
            f"after it (initialize_parallel_model(cfg, fn, False, *args)) or by keyword"
        )
    _model_parallel_state(config)
    local, original, info = build_in_waves(
        config.model_init_config.sequential_move_factor,
        lambda: _build_local(config, model_fn, include_buffers, model_args, model_kwargs),
        nxd_state.current_device(),
    )
    _check_sequence_parallel(config, original)
    if config.pad_model:
        _pad(config, local, info)
    from nxd_lora.model import lora_requested

    if lora_requested(config.lora_config, "initialize_parallel_model"):  # warns if switched off
        local = wrap_lora(local, config.lora_config)
    if config.activation_checkpoint_config is not None:
        classes = _checkpoint_classes(config, original, info)
        if config.pipeline_parallel_size > 1:
            pipeline: Any = local  # an NxDPPModel: its local modules and stages are read
            named = list(pipeline.local_named_modules())
            done = apply_activation_checkpointing(named, classes)
            _check_pipeline_reachable(pipeline.stages.values(), done)
        else:
            apply_activation_checkpointing(local.named_modules(), classes)
        _disable_kv_cache(original)
    del original  # at PP > 1 only the local stages stay referenced
    return NxDModel(local, config, info)


def _disable_kv_cache(model: Any) -> None:
    """A Hugging Face model's KV cache off under activation checkpointing, as Hugging Face's
    own gradient checkpointing does: a recomputed layer would append its keys and values to
    the cache a second time (older transformers default ``use_cache`` to True in training)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        logger.info("activation checkpointing: setting the model's config.use_cache = False")
        config.use_cache = False


# The optimizer ------------------------------------------------------------------------------
def _trainable(parameters: list[Any]) -> list[Any]:
    """Drop frozen parameters (LoRA's base): they never get a gradient nor optimizer state,
    ZeRO-1 shards trainable ones only, and a LoRA checkpoint in adapter mode holds no name
    for them."""
    out = []
    for item in parameters:
        if isinstance(item, dict):
            out.append({**item, "params": [p for p in item["params"] if p.requires_grad]})
        elif item.requires_grad:
            out.append(item)
    return [g for g in out if not isinstance(g, dict) or g["params"]]


def initialize_parallel_optimizer(
    nxd_config: Mapping[str, Any] | NxDConfig,
    optimizer_class: type[torch.optim.Optimizer],
    parameters: Iterable[Any],
    **defaults: Any,
) -> NxDOptimizer:
    """NxD's optimizer wrapper: ``optimizer_class(parameters, **defaults)`` inside
    :class:`nxd_optim.NxDOptimizer`, set up from ``optimizer_config`` and
    ``mixed_precision_config``.

    ``step()`` sums sequence-parallel gradients over TP, averages gradients over DP once
    (all-reduce, or ZeRO-1's reduce-scatter), clips the global norm across TP/PP/DP (read it
    as ``optimizer.grad_norm``), steps (fp32 masters for bf16 parameters when set) and, with
    ZeRO-1, all-gathers the parameters. Gradients of several ``run_train`` calls accumulate
    until ``step()``; after k of them ``optimizer.scale_gradients(1/k)`` makes their sum the
    mean. The optimizer holds the config's own ``optimizer_config`` and (resolved)
    ``mixed_precision_config`` as ``optimizer.config`` / ``optimizer.mixed_precision``.
    """
    from nxd_optim import NxDOptimizer

    config = NxDConfig.from_nxd(nxd_config)
    is_class = isinstance(optimizer_class, type)
    if not (is_class and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    pipe = config.pipeline_config
    pipelined = config.pipeline_parallel_size > 1 and pipe is not None
    if pipelined and pipe is not None and pipe.use_optimizer_wrapper is False:
        raise ValueError(
            "pipeline_config['use_optimizer_wrapper'] is False (the pipeline averages gradients "
            "over DP itself), so the optimizer wrapper would average them a second time: set it "
            "True or leave it out to use initialize_parallel_optimizer"
        )
    params = _trainable(list(parameters))
    if not params:
        raise ValueError("initialize_parallel_optimizer got no (trainable) parameters")
    _model_parallel_state(config)
    optimizer = NxDOptimizer(
        params,
        optimizer_class,
        config=config.optimizer_config,
        mixed_precision=config.mixed_precision_config,
        **defaults,
    )
    flat = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    models = claim_dp_reduction(flat)
    names = {id(p): n for model in models for n, p in model.named_parameters()}
    _PARAM_NAMES[optimizer] = [names.get(id(p)) for p in flat]
    return optimizer


def optimizer_param_names(optimizer: torch.optim.Optimizer) -> list[str | None] | None:
    """Names (in the wrapped model) of an optimizer's parameters, in param-group order, for
    saving its state by name; None for an optimizer not built by
    :func:`initialize_parallel_optimizer` (a name is None for a parameter of no NxDModel)."""
    return _PARAM_NAMES.get(optimizer)
