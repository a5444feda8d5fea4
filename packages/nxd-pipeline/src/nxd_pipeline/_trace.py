"""Graph capture: one flat ``torch.fx`` graph of the whole model, targets named as in the model.

Two routes, both ending in a :class:`CapturedGraph` whose ``get_attr`` / ``call_module`` targets
are the model's own qualified names (``model.layers.3.mlp.up_proj.weight``):

* ``tracer_cls="torch"`` (default) or a user ``torch.fx.Tracer`` subclass: symbolic tracing.
  Transformer layers (``transformer_layer_cls``), ``leaf_module_cls`` and the nxd parallel
  layers are leaves (one ``call_module`` node each); ``autowrap_modules`` /
  ``autowrap_functions`` are passed to the tracer; ``input_names`` are the traced inputs, the
  other ``forward`` parameters are fixed to their defaults.
* ``tracer_cls="hf"``: Hugging Face transformers 5 models, whose ``**kwargs`` forwards FX cannot
  trace, are captured with ``torch.export`` (non-strict, ``use_cache=False``, batch and sequence
  dimensions dynamic). Nodes carry ``nn_module_stack``, which places them in stages.
"""

from __future__ import annotations

import inspect
import logging
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn

__all__ = ["CapturedGraph", "PipelineTraceError", "capture_graph", "hf_layer_class"]

logger = logging.getLogger(__name__)


class PipelineTraceError(RuntimeError):
    """Graph capture failed; the message names the module and the operation, and what to do."""


@dataclass(kw_only=True)
class CapturedGraph:
    """A flat graph of the model's forward."""

    graph_module: fx.GraphModule
    """The traced module; its graph's targets are the original model's qualified names."""
    input_names: list[str]
    """Placeholders, in order: the keyword arguments ``run_train`` / ``run_eval`` take."""
    route: str
    """``"fx"`` or ``"export"``."""
    output_spec: Any = None
    """Export route: the pytree spec that rebuilds the model's output from the flat outputs."""
    fixed_inputs: dict[str, Any] = field(default_factory=dict)
    """Inputs fixed at capture time (``use_cache=False``), supplied when the caller omits them."""


def _nxd_leaf_classes() -> tuple[type, ...]:
    """The nxd parallel layers, which are always leaves (their collectives are not traceable)."""
    try:
        import nxd_layers
    except ImportError:  # pragma: no cover - nxd-layers is a dependency
        return ()
    names = [
        "ColumnParallelLinear",
        "RowParallelLinear",
        "ParallelEmbedding",
        "GQAQKVColumnParallelLinear",
    ]
    return tuple(getattr(nxd_layers, name) for name in names if hasattr(nxd_layers, name))


def _make_tracer(
    base: type[fx.Tracer],
    leaves: tuple[type, ...],
    autowrap_modules: Sequence[ModuleType],
    autowrap_functions: Sequence[Callable[..., Any]],
) -> fx.Tracer:
    class _LeafTracer(base):  # type: ignore[valid-type, misc]
        """Adds nxd's leaves to ``base`` and remembers which module is being traced."""

        def __init__(self) -> None:
            kwargs: dict[str, Any] = {}
            params = inspect.signature(base.__init__).parameters
            if "autowrap_modules" in params:
                kwargs["autowrap_modules"] = (math, *autowrap_modules)
            if "autowrap_functions" in params:
                kwargs["autowrap_functions"] = tuple(autowrap_functions)
            super().__init__(**kwargs)
            self.module_stack_names: list[tuple[str, str]] = []
            self.failed_in: list[tuple[str, str]] = []  # innermost module first

        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            if isinstance(m, leaves):
                return True
            return super().is_leaf_module(m, module_qualified_name)

        def call_module(
            self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
        ) -> Any:
            name = self.path_of_module(m)
            self.module_stack_names.append((name, type(m).__name__))
            try:
                return super().call_module(m, forward, args, kwargs)
            except Exception:
                self.failed_in.append(self.module_stack_names[-1])
                raise
            finally:
                self.module_stack_names.pop()

    return _LeafTracer()


def _failure_site(error: BaseException) -> str:
    """The innermost frame of the traceback outside torch: where user code did the op."""
    frames = traceback.extract_tb(error.__traceback__)
    outside = [f for f in frames if "/torch/" not in f.filename and "_trace.py" not in f.filename]
    frame = outside[-1] if outside else (frames[-1] if frames else None)
    if frame is None:
        return "an unknown location"
    return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"


def _trace_fx(
    module: nn.Module,
    input_names: Sequence[str] | None,
    tracer_cls: type[fx.Tracer],
    leaves: tuple[type, ...],
    autowrap_modules: Sequence[ModuleType],
    autowrap_functions: Sequence[Callable[..., Any]],
) -> CapturedGraph:
    signature = inspect.signature(module.forward)
    params = [
        p
        for p in signature.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    names = list(input_names) if input_names is not None else [p.name for p in params]
    unknown = [n for n in names if n not in signature.parameters]
    if unknown:
        raise ValueError(
            f"input_names {unknown} are not parameters of {type(module).__name__}.forward"
            f"{signature}"
        )
    concrete: dict[str, Any] = {}
    for p in params:
        if p.name not in names:
            if p.default is inspect.Parameter.empty:
                raise ValueError(
                    f"{type(module).__name__}.forward parameter {p.name!r} has no default and is "
                    f"not in input_names={names}: add it to input_names"
                )
            concrete[p.name] = p.default
    tracer = _make_tracer(tracer_cls, leaves, autowrap_modules, autowrap_functions)
    try:
        graph = tracer.trace(module, concrete_args=concrete or None)
    except Exception as error:
        stack = list(reversed(getattr(tracer, "failed_in", [])))  # innermost last
        where = (
            f"module {stack[-1][0] or '<root>'!r} ({stack[-1][1]})"
            if stack
            else f"{type(module).__name__}.forward"
        )
        raise PipelineTraceError(
            f"torch.fx could not trace {where}: {type(error).__name__}: {error} at "
            f"{_failure_site(error)}. Make that module a leaf (leaf_module_cls=[{stack[-1][1]}]) "
            f"if it is a layer, or wrap the offending function (autowrap_functions=(fn,) or "
            f"autowrap_modules=(module,)); for Hugging Face models use tracer_cls='hf'"
            if stack
            else f"torch.fx could not trace {where}: {type(error).__name__}: {error} at "
            f"{_failure_site(error)}. Wrap the offending function (autowrap_functions=(fn,) or "
            f"autowrap_modules=(module,)); for Hugging Face models use tracer_cls='hf'"
        ) from error
    graph_module = fx.GraphModule(module, graph, class_name=type(module).__name__)
    placeholders = [n.target for n in graph.nodes if n.op == "placeholder"]
    return CapturedGraph(
        graph_module=graph_module,
        input_names=[str(p) for p in placeholders if p in names],
        route="fx",
    )


def _hf_example_inputs(module: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    config = getattr(module, "config", None)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    # On the model's own device, meta included: torch 2.11 rejects an op that mixes a meta
    # parameter with a CPU input ("Unhandled FakeTensor Device Propagation ... meta, cpu").
    # A meta model's graph then has device=meta arguments, retargeted per stage.
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    shape = (2, 4)  # batch and sequence are dynamic: any size works later
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name in ("input_ids", "labels", "token_type_ids"):
            out[name] = torch.randint(0, vocab, shape, device=device)
        elif name == "attention_mask":
            out[name] = torch.ones(shape, dtype=torch.long, device=device)
        elif name == "position_ids":
            out[name] = torch.arange(shape[1], device=device).expand(shape)
        else:
            raise ValueError(
                f"tracer_cls='hf' builds example inputs for input_ids, attention_mask, labels, "
                f"position_ids and token_type_ids; it cannot guess {name!r}"
            )
    return out


# torch.export takes seconds: graphs are reused for models of the same class, config and
# parameter layout (the graph's attribute targets are resolved on the model at partition time).
_EXPORT_CACHE: dict[tuple[Any, ...], CapturedGraph] = {}


def _export_key(module: nn.Module, names: Sequence[str]) -> tuple[Any, ...]:
    layout = tuple(
        (name, tuple(t.shape), t.dtype, t.device.type)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    )
    return (type(module), repr(getattr(module, "config", None)), layout, tuple(names))


def _trace_export(module: nn.Module, input_names: Sequence[str] | None) -> CapturedGraph:
    names = list(input_names) if input_names is not None else ["input_ids", "labels"]
    key = _export_key(module, names)
    if key in _EXPORT_CACHE:
        logger.info("reusing the torch.export graph of an identical %s", type(module).__name__)
        return _EXPORT_CACHE[key]
    example = _hf_example_inputs(module, names)
    fixed = {"use_cache": False}
    dims = torch.export.Dim.AUTO
    dynamic = {name: {0: dims, 1: dims} for name in names}
    dynamic.update({name: None for name in fixed})
    logger.info("capturing %s with torch.export (non-strict)", type(module).__name__)
    try:
        exported = torch.export.export(
            module, (), {**example, **fixed}, strict=False, dynamic_shapes=dynamic
        )
    except Exception as error:
        raise PipelineTraceError(
            f"torch.export could not capture {type(module).__name__} with inputs {names}: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} at "
            f"{_failure_site(error)}. Check that forward accepts use_cache=False and that "
            f"input_names are its tensor inputs"
        ) from error
    graph_module = exported.module()
    placeholders = [str(n.target) for n in graph_module.graph.nodes if n.op == "placeholder"]
    captured = CapturedGraph(
        graph_module=graph_module,
        input_names=[p for p in placeholders if p not in fixed],
        route="export",
        output_spec=graph_module._out_spec,
        fixed_inputs=fixed,
    )
    _EXPORT_CACHE[key] = captured
    return captured


def capture_graph(
    module: nn.Module,
    *,
    tracer_cls: str | type[fx.Tracer] | None = None,
    input_names: Sequence[str] | None = None,
    leaf_module_cls: Sequence[type] = (),
    autowrap_modules: Sequence[ModuleType] = (),
    autowrap_functions: Sequence[Callable[..., Any]] = (),
) -> CapturedGraph:
    """Trace ``module`` into a :class:`CapturedGraph` (see the module docstring for routes)."""
    if tracer_cls == "hf":
        return _trace_export(module, input_names)
    if tracer_cls is None or tracer_cls == "torch":
        base: type[fx.Tracer] = fx.Tracer
    elif isinstance(tracer_cls, type) and issubclass(tracer_cls, fx.Tracer):
        base = tracer_cls
    else:
        raise ValueError(
            f"tracer_cls must be 'torch', 'hf', None or a torch.fx.Tracer subclass, got "
            f"{tracer_cls!r}"
        )
    leaves = (*_nxd_leaf_classes(), *leaf_module_cls)
    return _trace_fx(module, input_names, base, leaves, autowrap_modules, autowrap_functions)


def hf_layer_class(module: nn.Module) -> type | None:
    """Hugging Face models name their layer class in ``_no_split_modules``."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in names:
            return type(sub)
    return None
