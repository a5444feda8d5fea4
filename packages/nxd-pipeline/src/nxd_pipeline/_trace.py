"""Graph capture: one flat ``torch.fx`` graph of the whole model, targets named as in the model.

Two routes, both ending in a :class:`CapturedGraph` whose ``get_attr`` / ``call_module`` targets
are the model's own qualified names (``model.layers.3.mlp.up_proj.weight``):

* ``tracer_cls="torch"`` (default) or a user ``torch.fx.Tracer`` subclass: symbolic tracing.
  Transformer layers (``transformer_layer_cls``), ``leaf_module_cls`` and the nxd parallel
  layers are leaves (one ``call_module`` node each); ``autowrap_modules`` /
  ``autowrap_functions`` are passed to the tracer, nxd's TP mapping and parallel loss
  functions always autowrapped (one ``call_function`` node each), NxD's
  ``autowrap_obj_methods`` (``{obj: ["method", ...]}``) recorded as one call of the bound
  method; ``input_names`` are the traced inputs, the other ``forward`` parameters are fixed to
  their defaults.
* ``tracer_cls="hf"``: Hugging Face transformers 5 models, whose ``**kwargs`` forwards FX cannot
  trace, are captured with ``torch.export`` (:mod:`nxd_pipeline._export`); the transformer
  layers, ``leaf_module_cls`` modules and the nxd parallel layers are restored as
  ``call_module`` nodes, the rest is inlined, its nodes placed in stages by their
  ``nn_module_stack``.

Custom ``torch.autograd.Function``s (nxd's TP collectives) keep their backward only if they run
eagerly: both routes would record just their forward (:mod:`nxd_pipeline._functions`). So any
other module that applies one in its own code is found during the capture and kept as a module
call too (captured again); one applied in the root's ``forward`` is an error.

Leaf classes may be given by name (``"LlamaRMSNorm"``), as NxD allows: a name stands for every
class of that name among the model's modules.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from torch import fx, nn

from nxd_pipeline._autowrap import check_obj_methods, nxd_functions, wrapped_methods
from nxd_pipeline._captured import CapturedGraph, PipelineTraceError, failure_site
from nxd_pipeline._export import export_graph
from nxd_pipeline._functions import FunctionFrames, describe

__all__ = [
    "CapturedGraph",
    "PipelineTraceError",
    "capture_graph",
    "hf_layer_class",
    "nxd_parallel_classes",
    "resolve_module_classes",
]

logger = logging.getLogger(__name__)


def nxd_parallel_classes() -> tuple[type, ...]:
    """The nxd parallel layers (linear, GQA QKV, embedding, convolution) and the MoE block,
    always module calls: their collectives are custom autograd Functions, whose backward a
    traced graph drops (the MoE block's dispatch also has data-dependent shapes)."""
    try:
        import nxd_layers
        from nxd_layers.moe import MoE
    except ImportError:  # pragma: no cover - nxd-layers is a dependency
        return ()
    names = ["BaseParallelLinear", "ParallelEmbedding", "BaseParallelConv"]
    found = tuple(getattr(nxd_layers, name) for name in names if hasattr(nxd_layers, name))
    return (*found, MoE)


def _make_tracer(
    base: type[fx.Tracer],
    leaves: tuple[type, ...],
    leaf_names: frozenset[str],
    autowrap_modules: Sequence[ModuleType],
    autowrap_functions: Sequence[Callable[..., Any]],
) -> tuple[fx.Tracer, dict[str, set[str]]]:
    """A tracer of ``base`` with nxd's leaves, and its ``function_sites`` (filled as it
    traces)."""
    frames = FunctionFrames()

    class _LeafTracer(base):  # type: ignore[valid-type, misc]
        """Adds nxd's leaves to ``base``, remembers which module is being traced and which
        modules apply custom autograd Functions (``function_sites``)."""

        def __init__(self) -> None:
            kwargs: dict[str, Any] = {}
            params = inspect.signature(base.__init__).parameters
            if "autowrap_modules" in params:
                kwargs["autowrap_modules"] = (math, *autowrap_modules)
            if "autowrap_functions" in params:
                functions = (*autowrap_functions, *nxd_functions())
                kwargs["autowrap_functions"] = tuple(dict.fromkeys(functions))
            super().__init__(**kwargs)
            self.module_stack_names: list[tuple[str, str]] = []
            self.failed_in: list[tuple[str, str]] = []  # innermost module first
            self.function_sites: dict[str, set[str]] = {}

        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            if isinstance(m, leaves) or module_qualified_name in leaf_names:
                return True
            return super().is_leaf_module(m, module_qualified_name)

        def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any,
                         **options: Any) -> fx.Proxy:  # fmt: skip
            function = frames.current()
            if function is not None:  # an operation of a Function's forward
                where = self.module_stack_names[-1][0] if self.module_stack_names else ""
                self.function_sites.setdefault(where, set()).add(function)
            return super().create_proxy(kind, target, args, kwargs, *rest, **options)

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

    tracer = _LeafTracer()
    return tracer, tracer.function_sites


def _trace_fx(
    module: nn.Module,
    input_names: Sequence[str] | None,
    tracer_cls: type[fx.Tracer],
    leaves: tuple[type, ...],
    autowrap_modules: Sequence[ModuleType],
    autowrap_functions: Sequence[Callable[..., Any]],
    autowrap_obj_methods: Mapping[Any, Sequence[str]] | None,
) -> CapturedGraph:
    names, concrete = _forward_inputs(module, input_names)
    check_obj_methods(autowrap_obj_methods)
    # Modules applying custom autograd Functions become leaves: found by a first trace, kept
    # by a second (the Functions of leaves are not traced, so no new ones can appear).
    leaf_names: frozenset[str] = frozenset()
    for _ in range(2):
        tracer, sites = _make_tracer(
            tracer_cls, leaves, leaf_names, autowrap_modules, autowrap_functions
        )
        graph = _run_tracer(tracer, module, concrete, autowrap_obj_methods)
        if not sites:
            break
        if "" in sites:
            raise PipelineTraceError(
                f"torch.fx: {describe(module, {'': sites['']})}: a traced graph would keep only "
                f"its forward and drop its backward. Apply it inside a submodule (the capture "
                f"then keeps that module as a call) or autowrap the function applying it "
                f"(autowrap_functions=(fn,))"
            )
        logger.info(
            "torch.fx: keeping modules as leaves (module calls), since they apply custom "
            "autograd Functions whose backward a traced graph would drop: %s",
            describe(module, sites),
        )
        leaf_names = leaf_names | frozenset(sites)
    else:  # pragma: no cover - leaves are not traced into
        raise PipelineTraceError(f"torch.fx: custom autograd Functions still traced: {sites}")
    graph_module = fx.GraphModule(module, graph, class_name=type(module).__name__)
    placeholders = [n.target for n in graph.nodes if n.op == "placeholder"]
    return CapturedGraph(
        graph_module=graph_module,
        input_names=[str(p) for p in placeholders if p in names],
        route="fx",
        module_calls=list(
            dict.fromkeys(str(n.target) for n in graph.nodes if n.op == "call_module")
        ),
    )


def _forward_inputs(
    module: nn.Module, input_names: Sequence[str] | None
) -> tuple[list[str], dict[str, Any]]:
    """The traced inputs (``input_names``, default every named parameter of ``forward``) and
    the other parameters' defaults, which the trace fixes (one without a default is an
    error)."""
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
    return names, concrete


def _run_tracer(
    tracer: fx.Tracer,
    module: nn.Module,
    concrete: dict[str, Any],
    autowrap_obj_methods: Mapping[Any, Sequence[str]] | None,
) -> fx.Graph:
    try:
        with wrapped_methods(autowrap_obj_methods):
            return tracer.trace(module, concrete_args=concrete or None)
    except Exception as error:
        return _trace_failed(tracer, module, error)


def _trace_failed(tracer: fx.Tracer, module: nn.Module, error: Exception) -> fx.Graph:
    stack = list(reversed(getattr(tracer, "failed_in", [])))  # innermost last
    where = (
        f"module {stack[-1][0] or '<root>'!r} ({stack[-1][1]})"
        if stack
        else f"{type(module).__name__}.forward"
    )
    raise PipelineTraceError(
        f"torch.fx could not trace {where}: {type(error).__name__}: {error} at "
        f"{failure_site(error)}. Make that module a leaf (leaf_module_cls=[{stack[-1][1]}]) "
        f"if it is a layer, or wrap the offending function (autowrap_functions=(fn,) or "
        f"autowrap_modules=(module,)); for Hugging Face models use tracer_cls='hf'"
        if stack
        else f"torch.fx could not trace {where}: {type(error).__name__}: {error} at "
        f"{failure_site(error)}. Wrap the offending function (autowrap_functions=(fn,) or "
        f"autowrap_modules=(module,)); for Hugging Face models use tracer_cls='hf'"
    ) from error


def capture_graph(
    module: nn.Module,
    *,
    tracer_cls: str | type[fx.Tracer] | None = None,
    input_names: Sequence[str] | None = None,
    leaf_module_cls: Sequence[type | str] = (),
    autowrap_modules: Sequence[ModuleType] = (),
    autowrap_functions: Sequence[Callable[..., Any]] = (),
    autowrap_obj_methods: Mapping[Any, Sequence[str]] | None = None,
) -> CapturedGraph:
    """Trace ``module`` into a :class:`CapturedGraph` (see the module docstring for routes).

    ``leaf_module_cls``: classes, or class names, whose modules stay whole (one call each).
    With ``tracer_cls="hf"`` and none given, the model's transformer layer class. The nxd
    parallel layers, and modules applying custom autograd Functions, are module calls anyway.
    """
    leaf_module_cls = resolve_module_classes(module, leaf_module_cls, "leaf_module_cls")
    if tracer_cls == "hf":
        if autowrap_obj_methods:
            logger.warning(
                "autowrap_obj_methods applies to torch.fx tracing; torch.export "
                "(tracer_cls='hf') runs those methods inline"
            )
        keep = tuple(leaf_module_cls) or tuple(c for c in [hf_layer_class(module)] if c)
        return export_graph(module, input_names, (*keep, *nxd_parallel_classes()))
    if tracer_cls is None or tracer_cls == "torch":
        base: type[fx.Tracer] = fx.Tracer
    elif isinstance(tracer_cls, type) and issubclass(tracer_cls, fx.Tracer):
        base = tracer_cls
    else:
        raise ValueError(
            f"tracer_cls must be 'torch', 'hf', None or a torch.fx.Tracer subclass, got "
            f"{tracer_cls!r}"
        )
    leaves = (*nxd_parallel_classes(), *leaf_module_cls)
    return _trace_fx(
        module,
        input_names,
        base,
        leaves,
        autowrap_modules,
        autowrap_functions,
        autowrap_obj_methods,
    )


def hf_layer_class(module: nn.Module) -> type | None:
    """Hugging Face models name their layer class in ``_no_split_modules``."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in names:
            return type(sub)
    return None


def resolve_module_classes(
    module: nn.Module, specs: Sequence[type | str] | None, what: str
) -> tuple[type, ...]:
    """Classes for ``specs``: a class stands for itself, a name (NxD's form, e.g.
    ``"LlamaRMSNorm"``) for every class of that name among ``module``'s modules.

    A name that matches no module is ignored with a warning, as NxD ignores it (its tracer
    compares class names); anything else that is not a class is an error.
    """
    present: dict[str, list[type]] = {}
    for sub in module.modules():
        classes = present.setdefault(type(sub).__name__, [])
        if type(sub) not in classes:
            classes.append(type(sub))
    out: list[type] = []
    for spec in specs or ():
        if isinstance(spec, type):
            out.append(spec)
        elif isinstance(spec, str):
            if spec not in present:
                logger.warning(
                    "%s: no module of %s is of a class named %r; it is ignored",
                    what,
                    type(module).__name__,
                    spec,
                )
            out.extend(present.get(spec, []))
        else:
            raise TypeError(
                f"{what} takes classes or class names, got {spec!r} ({type(spec).__name__})"
            )
    return tuple(dict.fromkeys(out))
