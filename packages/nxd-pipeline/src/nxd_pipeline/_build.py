"""Build this rank's stages: from a captured graph cut at layer names, or from NxD's manual
layer list. Materialising meta parameters is left to a closure, run when NxDPPModel (or a model
wrapper, ``use_model_wrapper=True``) finishes the local stages."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from nxd_pipeline._captured import CapturedGraph
from nxd_pipeline._manual import assign_stages, build_manual_stages, materialize_manual
from nxd_pipeline._materialize import materialize_local_parameters, model_device
from nxd_pipeline._options import PipelineOptions
from nxd_pipeline._partition import (
    PartitionPlan,
    auto_pipeline_cuts,
    build_stage_module,
    partition_graph,
)
from nxd_pipeline._reduce import TiedWeight
from nxd_pipeline._schedules import stage_to_rank
from nxd_pipeline._shared import shared_weights
from nxd_pipeline._trace import capture_graph, hf_layer_class, resolve_module_classes

__all__ = ["LocalStages", "build_manual", "build_traced", "layer_class"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LocalStages:
    """This rank's stages, and what finishing them needs."""

    stages: dict[int, nn.Module]
    """Local stage index -> module (its names are the original model's)."""
    device: torch.device
    """Where the stages run."""
    materialize: Callable[[], dict[int, nn.Module] | None]
    """Materialises the local meta tensors (``param_init_fn``); returns rebuilt stages when
    the old ones held replaced tensors, else None."""
    tied: list[TiedWeight] = field(default_factory=list)
    """Weights held by several pipeline ranks, in the same order on every rank."""
    input_names: list[str] = field(default_factory=list)
    fixed_inputs: dict[str, Any] = field(default_factory=dict)
    output_spec: Any = None
    pipeline_cuts: list[str] = field(default_factory=list)
    layer_class: type | None = None


def layer_class(
    module: nn.Module, spec: type | str | None, tracer_cls: str | type[fx.Tracer] | None
) -> type | None:
    """The transformer layer class: given, named (a class name among the model's modules) or,
    for ``tracer_cls="hf"``, the one Hugging Face names in ``_no_split_modules``."""
    if spec is None:
        return hf_layer_class(module) if tracer_cls == "hf" else None
    if isinstance(spec, type):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"transformer_layer_cls must be a class or a class name, got {spec!r}")
    found = resolve_module_classes(module, [spec], "transformer_layer_cls")
    if len(found) != 1:
        classes = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(
            f"transformer_layer_cls={spec!r} must name exactly one module class of "
            f"{type(module).__name__}; found {len(found)}. Its classes: {classes[:20]}"
        )
    return found[0]


def build_traced(
    module: nn.Module, local: list[int], p: int, v: int, options: PipelineOptions
) -> LocalStages:
    """Capture, cut and keep the local stages ``local`` of ``p * v``."""
    layer = layer_class(module, options.transformer_layer_cls, options.tracer_cls)
    captured = _capture(module, options, layer)
    cuts = _pipeline_cuts(captured, module, options, layer, p, v)
    plan = partition_graph(captured, module, cuts, p * v)
    target = torch.device(options.device) if options.device is not None else model_device(module)

    def build() -> dict[int, nn.Module]:
        return {s: build_stage_module(plan, module, s, target) for s in local}

    def materialize() -> dict[int, nn.Module] | None:
        params = [plan.stage_parameters[s] for s in local]
        buffers = [plan.stage_buffers[s] for s in local]
        if materialize_local_parameters(module, params, target, options.param_init_fn, buffers):
            return build()  # the stages' attributes must be the new tensors
        return None

    return LocalStages(
        stages=build(),
        device=target,
        materialize=materialize,
        tied=_tied_weights(plan, local, p),
        input_names=captured.input_names,
        fixed_inputs=captured.fixed_inputs,
        output_spec=captured.output_spec,
        pipeline_cuts=cuts,
        layer_class=layer,
    )


def _capture(module: nn.Module, options: PipelineOptions, layer: type | None) -> CapturedGraph:
    """The model's graph, the layer class and ``leaf_module_cls`` kept whole; written to
    ``trace_file_path`` if given."""
    leaves = list(resolve_module_classes(module, options.leaf_module_cls, "leaf_module_cls"))
    if layer is not None:
        leaves.append(layer)
    captured = capture_graph(
        module,
        tracer_cls=options.tracer_cls,
        input_names=options.input_names,
        leaf_module_cls=tuple(leaves),
        autowrap_modules=tuple(options.autowrap_modules or ()),
        autowrap_functions=tuple(options.autowrap_functions or ()),
        autowrap_obj_methods=options.autowrap_obj_methods,
    )
    if options.trace_file_path is not None:
        with open(options.trace_file_path, "w") as handle:
            handle.write(str(captured.graph_module.graph))
    return captured


def _pipeline_cuts(
    captured: CapturedGraph,
    module: nn.Module,
    options: PipelineOptions,
    layer: type | None,
    p: int,
    v: int,
) -> list[str]:
    """The p·v - 1 cuts: given, or chosen among the layers with ``auto_partition``."""
    num_stages = p * v
    if num_stages == 1 or options.pipeline_cuts:
        return list(options.pipeline_cuts or [])
    if not options.auto_partition:
        raise ValueError(
            f"pipeline size {p} x virtual pipeline size {v} = {num_stages} stages need "
            f"{num_stages - 1} pipeline_cuts (layer names), or auto_partition=True"
        )
    if layer is None:
        raise ValueError("auto_partition=True needs transformer_layer_cls")
    layers = [n for n, m in module.named_modules() if isinstance(m, layer)]
    return list(auto_pipeline_cuts(captured, module, layers, num_stages))


def _tied_weights(plan: PartitionPlan, local: list[int], p: int) -> list[TiedWeight]:
    """Parameters used by stages on several pipeline ranks (tied embeddings), with this rank's
    name for each (None where it holds no copy)."""
    tied = []
    for group in plan.shared_parameters():
        if len({stage_to_rank(s, p) for s in group}) > 1:
            first = plan.stage_parameters[min(group)][group[min(group)]]
            mine = next((group[s] for s in local if s in group), None)
            first_rank = stage_to_rank(min(group), p)
            tied.append(TiedWeight(mine, tuple(first.shape), first.dtype, first_rank))
    return tied


def build_manual(
    layers: list[nn.Module],
    local: list[int],
    p: int,
    v: int,
    rank: int,
    options: PipelineOptions,
) -> LocalStages:
    """NxD's manual mode: the local stages of the layer list."""
    stage_of = assign_stages(layers, p * v, options.manual_pp_stage_partition_fn)
    device = options.device
    target = torch.device(device) if device is not None else model_device(*layers)
    loss_fn, loss_spec = options.manual_pp_loss_fn, options.output_loss_value_spec
    stages = build_manual_stages(layers, stage_of, local, loss_fn, loss_spec)

    def materialize() -> None:  # in place: the stages hold the layers themselves
        materialize_manual(layers, stage_of, local, target, options.param_init_fn)

    names = {id(q): n for s in stages.values() for n, q in s.named_parameters()}
    shared = shared_weights(layers, stage_of, p, rank)
    tied = [
        TiedWeight(
            names[id(w.local)] if w.local is not None else None, w.shape, w.dtype, w.stages[0] % p
        )
        for w in shared
    ]
    logger.info(
        "manual partition: layers per stage %s; weights shared across pipeline ranks: %s",
        [stage_of.count(s) for s in range(max(stage_of) + 1)],
        [weight.group for weight in shared],
    )
    return LocalStages(
        stages=dict(stages),
        device=target,
        materialize=materialize,
        tied=tied,
        input_names=["inputs", "labels"],
    )
