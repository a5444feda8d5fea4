"""The ``tracer_cls="hf"`` route: capture a Hugging Face model with ``torch.export``, keeping its
transformer layers (and ``leaf_module_cls`` modules) as module calls.

transformers 5 models forward ``**kwargs`` and build masks with data-dependent Python, which
``torch.fx`` cannot trace; ``torch.export`` (non-strict, ``use_cache=False``, batch and sequence
dimensions dynamic) can, but it inlines every module into aten operations. A layer whose
operations sit in the stage graph cannot be recomputed by activation checkpointing, hooked, or
swapped. So the layers are exported with ``preserve_module_call_signature``: the exported
program then records, for each layer call, which graph values went in (``in_spec``: the
positional and keyword arguments, constants such as ``use_cache=False`` included) and which
came out. Each layer's inlined nodes are replaced by one ``call_module`` node calling the
original module with those arguments: ``h_{i+1} = layer_i(h_i, attention_mask=m, ...)``,
the same function, run eagerly by the stage. Everything outside the kept modules (masks,
rotary tables, plain norms and heads, the loss) stays as exported.

Modules applying custom autograd Functions must be kept (a Function's backward is lost when its
forward is inlined, :mod:`nxd_pipeline._functions`): the export watches the autograd graph,
and a module found applying one outside the kept modules is added to them and the model
exported again. If a module that applies one cannot be kept as a call (called twice, an input
computed after it starts, the root's own ``forward``), the capture fails instead of training
with wrong gradients.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from nxd_pipeline._captured import CapturedGraph, PipelineTraceError, failure_site
from nxd_pipeline._functions import (
    containing,
    describe,
    outermost,
    uncovered,
    watch_autograd_functions,
)

__all__ = ["export_graph", "modules_to_keep"]

logger = logging.getLogger(__name__)


def _example_inputs(module: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    config = getattr(module, "config", None)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    # On the model's own device, meta included: torch 2.11 rejects an op that mixes a meta
    # parameter with a CPU input ("Unhandled FakeTensor Device Propagation ... meta, cpu").
    # A meta model's graph then has device=meta arguments, retargeted per stage.
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    shape = (2, 4)  # batch and sequence are dynamic: any size works later
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name in ("input_ids", "labels", "shift_labels", "token_type_ids"):
            out[name] = torch.randint(0, vocab, shape, device=device)
        elif name == "attention_mask":
            out[name] = torch.ones(shape, dtype=torch.long, device=device)
        elif name == "position_ids":
            out[name] = torch.arange(shape[1], device=device).expand(shape)
        else:
            raise ValueError(
                f"tracer_cls='hf' builds example inputs for input_ids, attention_mask, labels, "
                f"shift_labels, position_ids and token_type_ids; it cannot guess {name!r}"
            )
    return out


def modules_to_keep(module: nn.Module, classes: Sequence[type]) -> list[str]:
    """Qualified names of the modules of ``classes``, outermost only (a kept module's
    submodules run inside its call)."""
    kept: list[str] = []
    for name, sub in module.named_modules():
        nested = any(name.startswith(outer + ".") for outer in kept)
        if name and isinstance(sub, tuple(classes)) and not nested:
            kept.append(name)
    return kept


# torch.export takes seconds: graphs are reused for Hugging Face models of the same class,
# config, attention implementation, mode and parameter layout (the graph's attribute targets
# are resolved on the model at partition time). Other models are exported each time: their
# graphs may depend on constructor arguments no key can see.
_EXPORT_CACHE: dict[tuple[Any, ...], CapturedGraph] = {}


def _cache_key(
    module: nn.Module, names: Sequence[str], keep: Sequence[str]
) -> tuple[Any, ...] | None:
    config = getattr(module, "config", None)
    if not callable(getattr(config, "to_json_string", None)):
        return None
    layout = tuple(
        (name, tuple(t.shape), t.dtype, t.device.type)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    )
    attention = getattr(config, "_attn_implementation", None)
    # A loss function set on the model (transformers' loss_function setter) is in the graph.
    loss = module.__dict__.get("_loss_function")
    described = (repr(config), attention, module.training, loss)
    return (type(module), described, layout, tuple(names), tuple(keep))


@contextlib.contextmanager
def _autocast_on_meta() -> Iterator[None]:
    """``torch.autocast(device_type="meta", enabled=False)`` allowed while capturing.

    Models commonly switch autocast off around precision-sensitive code for the device of
    their inputs (``torch.autocast(device_type=x.device.type, enabled=False)``, e.g. rotary
    tables); capturing a meta-device model makes that ``"meta"``, which torch refuses
    ("unsupported scalarType"). Switching autocast off changes nothing in a capture made with
    autocast off, so the block is entered for this rank's device type instead. Switching
    autocast *on* for ``"meta"`` would need the dtype the real device would cast to: refused.
    """
    import nxd_state

    original = torch.autocast
    rank_device_type = nxd_state.current_device().type

    class _Autocast(original):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            if device_type == "meta":
                enabled = kwargs.get("enabled", args[1] if len(args) > 1 else True)
                if enabled:
                    raise PipelineTraceError(
                        "the model enables torch.autocast for its inputs' device while being "
                        "captured on the meta device; build it with meta_device_init=False, "
                        "or enable autocast around run_train instead"
                    )
                device_type = rank_device_type
            super().__init__(device_type, *args, **kwargs)

    torch.autocast = torch.amp.autocast = _Autocast  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast = torch.amp.autocast = original  # type: ignore[misc]


def _export(
    module: nn.Module, kwargs: dict[str, Any], dynamic: dict[str, Any], keep: Sequence[str]
) -> torch.export.ExportedProgram:
    on_meta = any(p.is_meta for p in module.parameters())
    with _autocast_on_meta() if on_meta else contextlib.nullcontext():
        return torch.export.export(
            module,
            (),
            kwargs,
            strict=False,
            dynamic_shapes=dynamic,
            preserve_module_call_signature=tuple(keep),
        )


def _export_keeping(
    module: nn.Module, kwargs: dict[str, Any], dynamic: dict[str, Any], keep: list[str]
) -> tuple[torch.export.ExportedProgram, list[str], dict[str, set[str]]]:
    """Export with ``keep`` preserved, plus every module found applying a custom autograd
    Function outside them. Returns the program, the modules kept and where Functions are."""
    sites: dict[str, set[str]] = {}
    try:
        with watch_autograd_functions(module) as sites:
            exported = _export(module, kwargs, dynamic, keep)
    except Exception as error:
        if not keep:
            raise
        # Preserving the calls constrains export (each kept module called once, with pytree
        # inputs and outputs); without it the model may still export, inlined, except the
        # modules applying autograd Functions (their backward needs the call).
        needed = containing(keep, sites)
        logger.warning(
            "torch.export failed when keeping %s as module calls (%s: %s); exporting with %s "
            "(no activation checkpointing of the others at PP > 1)",
            keep[:4],
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
            f"only {needed} kept (they apply custom autograd Functions)"
            if needed
            else "every module inlined",
        )
        keep = needed
        with watch_autograd_functions(module) as sites:
            exported = _export(module, kwargs, dynamic, keep)
    extra = uncovered(sites, keep)
    if not extra:
        return exported, keep, sites
    if "" in extra:
        raise PipelineTraceError(
            f"torch.export: {describe(module, {'': extra['']})}: a captured graph would keep "
            f"only its forward and drop its backward. Apply it inside a submodule (the capture "
            f"then keeps that module as a call)"
        )
    keep = outermost([*keep, *extra])
    logger.info(
        "torch.export: keeping modules as calls, since they apply custom autograd Functions "
        "whose backward an inlined graph would drop: %s; exporting again",
        describe(module, extra),
    )
    with watch_autograd_functions(module) as sites:
        exported = _export(module, kwargs, dynamic, keep)
    return exported, keep, sites


def export_graph(
    module: nn.Module, input_names: Sequence[str] | None, keep_classes: Sequence[type]
) -> CapturedGraph:
    """Export ``module`` and restore a module call for every module of ``keep_classes`` (and
    every module applying a custom autograd Function)."""
    names = list(input_names) if input_names is not None else ["input_ids", "labels"]
    keep = modules_to_keep(module, keep_classes)
    key = _cache_key(module, names, keep)
    if key is not None and key in _EXPORT_CACHE:
        logger.info("reusing the torch.export graph of an identical %s", type(module).__name__)
        return _EXPORT_CACHE[key]
    example = _example_inputs(module, names)
    fixed = {"use_cache": False} if _accepts(module, "use_cache") else {}
    dims = torch.export.Dim.AUTO
    dynamic: dict[str, Any] = {name: {0: dims, 1: dims} for name in names}
    dynamic.update({name: None for name in fixed})
    logger.info(
        "capturing %s with torch.export (non-strict), keeping %d module calls",
        type(module).__name__,
        len(keep),
    )
    try:
        exported, keep, sites = _export_keeping(module, {**example, **fixed}, dynamic, keep)
    except PipelineTraceError:
        raise
    except Exception as error:
        raise PipelineTraceError(
            f"torch.export could not capture {type(module).__name__} with inputs {names}: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} at "
            f"{failure_site(error)}. Check that forward accepts use_cache=False and that "
            f"input_names are its tensor inputs"
        ) from error
    _fix_keyword_guards(exported, module, [*names, *fixed])
    graph_module = exported.module()
    restored = _restore_module_calls(module, graph_module, exported, keep, sites)
    graph_module.recompile()
    placeholders = [str(n.target) for n in graph_module.graph.nodes if n.op == "placeholder"]
    captured = CapturedGraph(
        graph_module=graph_module,
        input_names=[p for p in placeholders if p not in fixed],
        route="export",
        output_spec=graph_module._out_spec,
        fixed_inputs=fixed,
        module_calls=restored,
    )
    if key is not None:
        _EXPORT_CACHE[key] = captured
    return captured


def _restore_module_calls(
    module: nn.Module,
    graph_module: fx.GraphModule,
    exported: torch.export.ExportedProgram,
    keep: list[str],
    sites: dict[str, set[str]],
) -> list[str]:
    """Put back a call of every module in ``keep`` that can run as one; returns those. A
    module applying a custom autograd Function that is not restored is an error (inlined,
    its backward would be dropped)."""
    nodes = {n.name: n for n in graph_module.graph.nodes}  # by name, updated as calls replace
    restored, failed = [], {}
    for name in keep:
        reason = _restore_module_call(graph_module.graph, exported, name, nodes)
        if reason is None:
            restored.append(name)
        else:
            failed[name] = reason
    lost = uncovered(sites, restored)
    if lost:
        reasons = {k: failed[k] for k in containing(list(failed), lost)}
        raise PipelineTraceError(
            f"torch.export: {describe(module, lost)}, but the module cannot run as a module "
            f"call ({'; '.join(f'{k} {r}' for k, r in reasons.items()) or 'not kept'}), and "
            f"inlined, the Function's backward would be dropped (wrong gradients). Call the "
            f"module once per forward, with tensor inputs computed before it"
        )
    return restored


def _fix_keyword_guards(
    exported: torch.export.ExportedProgram, module: nn.Module, names: Sequence[str]
) -> None:
    """Name the inputs that ``forward`` takes through its ``**kwargs`` (transformers' loss
    arguments: ``shift_labels``) as the guard function can find them.

    torch (2.15) writes a guard on such an input's shape as ``L['kwargs']['shift_labels']``, a
    path the exported module's guard function has no placeholder for (a ``NameError`` on
    every call); the input is the top-level keyword ``L['shift_labels']``, which it has.
    Guards are kept, only their paths are corrected. torch versions without ``_guards_code``
    are left alone."""
    code = getattr(exported, "_guards_code", None)
    var_keyword = [
        p.name
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind is inspect.Parameter.VAR_KEYWORD
    ]
    if not isinstance(code, list) or not var_keyword:
        return
    fixed = []
    for guard in code:
        for name in names:
            guard = guard.replace(f"L['{var_keyword[0]}']['{name}']", f"L['{name}']")
        fixed.append(guard)
    exported._guards_code = fixed


def _accepts(module: nn.Module, name: str) -> bool:
    """Whether ``module.forward`` takes the keyword ``name`` (or any keyword)."""
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _inside(node: fx.Node, name: str) -> bool:
    paths = (str(value[0]) for value in node.meta.get("nn_module_stack", {}).values())
    return any(path == name or path.startswith(name + ".") for path in paths)


def _argument(spec: Any, nodes: dict[str, fx.Node]) -> Any:
    """A graph value (node) or a constant for one input of a preserved call signature."""
    if isinstance(spec, torch.export.graph_signature.ConstantArgument):
        return spec.value
    name = getattr(spec, "name", None)
    if name in nodes:
        return nodes[name]
    raise KeyError(f"{type(spec).__name__} {name!r} is not a node of the graph")


def _leaf_accessors(graph: fx.Graph, call: fx.Node, spec: pytree.TreeSpec) -> list[fx.Node]:
    """Nodes picking each pytree leaf out of ``call``'s result, in flattening order."""
    template = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    leaves: list[fx.Node] = [call] * spec.num_leaves
    for path, index in pytree.tree_flatten_with_path(template)[0]:
        node = call
        for key in path:
            if isinstance(key, pytree.SequenceKey):
                node = graph.call_function(operator.getitem, (node, key.idx))
            elif isinstance(key, pytree.MappingKey):
                node = graph.call_function(operator.getitem, (node, key.key))
            elif isinstance(key, pytree.GetAttrKey):  # dataclass-like outputs
                node = graph.call_function(getattr, (node, key.name))
            else:
                raise PipelineTraceError(
                    f"an output leaf's pytree key {key!r} is none of SequenceKey, MappingKey, "
                    "GetAttrKey: cannot pick it out of the stage's result"
                )
        leaves[index] = node
    return leaves


def _restore_module_call(
    graph: fx.Graph,
    exported: torch.export.ExportedProgram,
    name: str,
    nodes: dict[str, fx.Node],
) -> str | None:
    """Replace the inlined nodes of module ``name`` by one ``call_module`` node; when its
    recorded call cannot be rebuilt, the reason (the module stays inlined).

    ``nodes``: the graph's values under their exported names (a replaced output's name maps to
    the node that now yields it), which the recorded signatures refer to.
    """
    entry = next((e for e in exported.module_call_graph if e.fqn == name), None)
    signature = entry.signature if entry is not None else None
    inside = [n for n in graph.nodes if _inside(n, name)]
    if signature is None or not inside:
        return _not_kept(name, "has no recorded call signature")
    if any(e.fqn.startswith(name + "@") for e in exported.module_call_graph):
        # Called several times: its calls' nodes share one nn_module_stack entry.
        return _not_kept(name, "is called more than once")
    try:
        args, kwargs = pytree.tree_unflatten(
            [_argument(a, nodes) for a in signature.inputs], signature.in_spec
        )
        outputs = [_argument(a, nodes) for a in signature.outputs]
    except (KeyError, ValueError, TypeError) as error:
        return _not_kept(name, f"has a call that cannot be rebuilt ({error})")
    # Every input exists before the module's first operation (export records execution
    # order), so the call goes there; its outputs replace the inlined results.
    order = {n: i for i, n in enumerate(graph.nodes)}
    late = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Node)]
    if any(order[a] >= order[inside[0]] for a in late):
        return _not_kept(name, "has an input computed after it starts")
    with graph.inserting_before(inside[0]):
        # (create_node: the exported module has no submodule for a module without tensors;
        # stages resolve call targets on the model.)
        call = graph.create_node("call_module", name, tuple(args), dict(kwargs))
        leaves = _leaf_accessors(graph, call, signature.out_spec)
    stack = dict(inside[0].meta.get("nn_module_stack", {}))
    call.meta["nn_module_stack"] = {
        k: v for k, v in stack.items() if not _inside_path(str(v[0]), name)
    }
    for spec, old, new in zip(signature.outputs, outputs, leaves):
        if isinstance(old, fx.Node):
            old.replace_all_uses_with(new)
            nodes[spec.name] = new
    for node in reversed(inside):
        if not node.users:
            graph.erase_node(node)
    prefix = name + "."
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users and str(node.target).startswith(prefix):
            graph.erase_node(node)
    left = [n.name for n in graph.nodes if _inside(n, name)]
    if left:  # used outside the module too (e.g. a size): computed there, harmlessly
        logger.debug("module %s: %d inlined nodes still used outside it: %s", name, len(left), left)
    return None


def _not_kept(name: str, reason: str) -> str:
    logger.warning("module %s %s; it stays inlined", name, reason)
    return reason


def _inside_path(path: str, name: str) -> bool:
    return path == name or path.startswith(name + ".")
