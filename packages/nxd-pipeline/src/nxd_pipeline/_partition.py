"""Partition a captured graph into pipeline stages and build one stage as its own module.

Stage ``k`` holds the nodes after the ``k``-th cut and up to the ``k+1``-th; a cut names a
module (``model.layers.1``) and falls after the last node executed inside it. Three refinements
keep what crosses a boundary small and made of tensors:

* parameters and buffers (``get_attr``) are never sent: every stage that uses one reads it;
* values computed from the model inputs alone (masks, position ids, rotary tables) are
  recomputed by each stage that needs them, since every rank receives the whole batch;
* ``getitem`` of a tuple made in an earlier stage moves to that stage, so tuples never cross.

A stage module is an ``fx.GraphModule`` whose attributes sit under the model's own qualified
names, taken from the model itself: parameter names and identities are the original ones.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from nxd_pipeline._captured import CapturedGraph, PipelineTraceError

__all__ = ["PartitionPlan", "auto_pipeline_cuts", "partition_graph"]

logger = logging.getLogger(__name__)

_RANDOM_OPS = ("dropout", "rand", "bernoulli", "normal")


@dataclass(kw_only=True)
class PartitionPlan:
    """Where every node of a captured graph runs, and what crosses each stage boundary."""

    captured: CapturedGraph
    """The graph being partitioned."""
    num_stages: int
    """Number of stages S (pipeline size times virtual pipeline size)."""
    stage_of: dict[fx.Node, int] = field(default_factory=dict)
    """Stage of each computing node (parameters, buffers and replicated nodes excluded)."""
    replicated: set[fx.Node] = field(default_factory=set)
    """Nodes computed from model inputs only, recomputed by every stage that uses them."""
    crossing: list[list[fx.Node]] = field(default_factory=list)
    """``crossing[b]``: values sent from stage b to stage b+1, in graph order."""
    stage_parameters: list[dict[str, nn.Parameter]] = field(default_factory=list)
    """Per stage: original name -> parameter (shared parameters appear in several stages)."""
    stage_buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per stage: original name -> buffer of the model the stage reads."""

    def shared_parameters(self) -> list[dict[int, str]]:
        """Parameters used by several stages (tied weights): per group, stage -> local name."""
        groups: dict[int, dict[int, str]] = {}
        for stage, params in enumerate(self.stage_parameters):
            for name, param in params.items():
                groups.setdefault(id(param), {}).setdefault(stage, name)
        return [group for group in groups.values() if len(group) > 1]


def _attribute(obj: object, target: str) -> object:
    """``obj.a.b.c`` for ``target`` "a.b.c" (AttributeError when a part is missing)."""
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve(root: nn.Module, fallback: nn.Module, target: str) -> object:
    for source in (root, fallback):
        try:
            return _attribute(source, target)
        except AttributeError:
            continue
    raise AttributeError(f"{target!r} is neither in the model nor in its traced graph")


def _module_paths(node: fx.Node) -> set[str]:
    paths = {str(value[0]) for value in node.meta.get("nn_module_stack", {}).values()}
    if node.op == "call_module":
        paths.add(str(node.target))
    return paths


def _matches(paths: set[str], name: str) -> bool:
    return any(path == name or path.startswith(name + ".") for path in paths)


def cut_positions(captured: CapturedGraph, names: Sequence[str]) -> list[int]:
    """Index of the last node executed inside each named module (a cut falls after it)."""
    nodes = list(captured.graph_module.graph.nodes)
    paths = [_module_paths(node) for node in nodes]
    positions = []
    calls = [str(n.target) for n in nodes if n.op == "call_module"]
    for name in names:
        hits = [i for i, node_paths in enumerate(paths) if _matches(node_paths, name)]
        around = [c for c in calls if name.startswith(c + ".")]
        if around:
            raise ValueError(
                f"pipeline cut {name!r} falls inside module {around[0]!r}, which runs as one "
                f"module call (a leaf, or a module applying a custom autograd Function): cut "
                f"at {around[0]!r} or outside it"
            )
        if not hits:
            seen = sorted({p for node_paths in paths for p in node_paths if p.count(".") <= 2})
            raise ValueError(
                f"pipeline cut {name!r} names no module executed in the traced graph; "
                f"modules seen include {seen[:20]}"
            )
        positions.append(max(hits))
    return positions


def _is_parameter(captured: CapturedGraph, root: nn.Module, node: fx.Node) -> bool:
    if node.op == "get_attr":
        obj = _resolve(root, captured.graph_module, str(node.target))
        return isinstance(obj, torch.Tensor) and (
            isinstance(obj, nn.Parameter) or obj.requires_grad
        )
    if node.op == "call_module":
        module = _resolve(root, captured.graph_module, str(node.target))
        return isinstance(module, nn.Module) and any(True for _ in module.parameters())
    return False


def partition_graph(
    captured: CapturedGraph, root: nn.Module, cuts: Sequence[str], num_stages: int
) -> PartitionPlan:
    """Assign every node of ``captured`` to one of ``len(cuts) + 1`` stages."""
    positions = _checked_cut_positions(captured, cuts, num_stages)
    plan = PartitionPlan(captured=captured, num_stages=num_stages)
    nodes = list(captured.graph_module.graph.nodes)
    _mark_replicated(plan, root, nodes)
    _assign_stages(plan, nodes, positions)
    _find_crossing(plan, nodes)
    _collect_stage_state(plan, root)
    logger.info(
        "partitioned into %d stages; crossing values per boundary: %s",
        num_stages,
        [len(values) for values in plan.crossing],
    )
    return plan


def _checked_cut_positions(
    captured: CapturedGraph, cuts: Sequence[str], num_stages: int
) -> list[int]:
    """Graph positions of the cuts' last nodes: ``num_stages - 1`` of them, increasing."""
    if len(cuts) != num_stages - 1:
        raise ValueError(
            f"pipeline_cuts has {len(cuts)} names {list(cuts)}, but {num_stages} stages need "
            f"{num_stages - 1} cuts (pipeline size x virtual pipeline size - 1)"
        )
    positions = cut_positions(captured, cuts)
    if positions != sorted(positions) or len(set(positions)) != len(positions):
        raise ValueError(
            f"pipeline_cuts {list(cuts)} are not in execution order (their last nodes are at "
            f"graph positions {positions})"
        )
    return positions


def _mark_replicated(plan: PartitionPlan, root: nn.Module, nodes: list[fx.Node]) -> None:
    """1. Values computed from inputs only (no parameter, no random op): replicated where
    used."""
    captured = plan.captured
    for node in nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node.op == "call_module" and _is_parameter(captured, root, node):
            continue
        if any(op in str(node.target) for op in _RANDOM_OPS):
            continue
        if all(
            n.op == "placeholder"
            or (n.op == "get_attr" and not _is_parameter(captured, root, n))
            or n in plan.replicated
            for n in node.all_input_nodes
        ):
            plan.replicated.add(node)


def _assign_stages(plan: PartitionPlan, nodes: list[fx.Node], positions: list[int]) -> None:
    """2. Everything else by position; getitem of an earlier tuple joins its producer."""
    for index, node in enumerate(nodes):
        if node.op in ("placeholder", "get_attr") or node in plan.replicated:
            continue
        if node.op == "output":
            plan.stage_of[node] = plan.num_stages - 1
            continue
        stage = sum(1 for position in positions if position < index)
        if node.target is operator.getitem and node.args[0] in plan.stage_of:
            stage = min(stage, plan.stage_of[node.args[0]])  # type: ignore[index]
        plan.stage_of[node] = stage
    # Replicated nodes nobody uses (shape guards, asserts) run once, on the first stage.
    for node in list(plan.replicated):
        if not node.users:
            plan.replicated.discard(node)
            plan.stage_of[node] = 0


def _find_crossing(plan: PartitionPlan, nodes: list[fx.Node]) -> None:
    """3. What crosses each boundary: a value from its stage up to its last user's."""
    plan.crossing = [[] for _ in range(plan.num_stages - 1)]
    for node in nodes:
        if node not in plan.stage_of or node.op == "output":
            continue
        last_user = max((plan.stage_of.get(u, -1) for u in node.users), default=-1)
        for boundary in range(plan.stage_of[node], last_user):
            plan.crossing[boundary].append(node)


def _collect_stage_state(plan: PartitionPlan, root: nn.Module) -> None:
    """4. Parameters and buffers per stage, under their original names."""
    captured = plan.captured
    plan.stage_parameters = [{} for _ in range(plan.num_stages)]
    plan.stage_buffers = [{} for _ in range(plan.num_stages)]
    model_buffers = {id(b) for b in root.buffers()}
    for stage in range(plan.num_stages):
        for node in _stage_attribute_nodes(plan, stage):
            obj = _resolve(root, captured.graph_module, str(node.target))
            if isinstance(obj, nn.Parameter):
                plan.stage_parameters[stage][str(node.target)] = obj
            elif isinstance(obj, torch.Tensor) and id(obj) in model_buffers:
                plan.stage_buffers[stage][str(node.target)] = obj
            elif isinstance(obj, nn.Module):
                for name, param in obj.named_parameters():
                    plan.stage_parameters[stage][f"{node.target}.{name}"] = param
                for name, buffer in obj.named_buffers():
                    plan.stage_buffers[stage][f"{node.target}.{name}"] = buffer


def _needed_replicated(plan: PartitionPlan, stage: int) -> set[fx.Node]:
    needed: set[fx.Node] = set()
    frontier = [n for n, s in plan.stage_of.items() if s == stage]
    while frontier:
        node = frontier.pop()
        for dep in node.all_input_nodes:
            if dep in plan.replicated and dep not in needed:
                needed.add(dep)
                frontier.append(dep)
    return needed


def _stage_attribute_nodes(plan: PartitionPlan, stage: int) -> list[fx.Node]:
    members = {n for n, s in plan.stage_of.items() if s == stage} | _needed_replicated(plan, stage)
    out = [n for n in members if n.op == "call_module"]
    for node in members:
        out += [dep for dep in node.all_input_nodes if dep.op == "get_attr"]
    return list(dict.fromkeys(out))


def build_stage_module(
    plan: PartitionPlan, root: nn.Module, stage: int, device: torch.device | None = None
) -> StageModule:
    """Stage ``stage`` as a module: ``forward(*received, **inputs) -> outputs``.

    ``device``: where the stage runs; a graph captured from a meta-device model has ``meta``
    baked into its ``device=`` arguments, which are retargeted to it.
    """
    captured = plan.captured
    members = {n for n, s in plan.stage_of.items() if s == stage} | _needed_replicated(plan, stage)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    received = plan.crossing[stage - 1] if stage > 0 else []
    for node in received:
        env[node] = graph.placeholder(f"recv_{node.name}")
    input_names: list[str] = []
    needed_inputs = {dep for n in members for dep in n.all_input_nodes if dep.op == "placeholder"}
    for node in captured.graph_module.graph.nodes:
        if node in needed_inputs:
            env[node] = graph.placeholder(str(node.target))
            input_names.append(str(node.target))
    attributes: dict[str, object] = {}
    for node in captured.graph_module.graph.nodes:
        if node.op == "get_attr" and any(u in members for u in node.users):
            env[node] = graph.node_copy(node, lambda n: env[n])
            value = _resolve(root, captured.graph_module, str(node.target))
            _check_not_meta_constant(root, str(node.target), value, stage)
            if device is not None and isinstance(value, fx.GraphModule):
                value = _retarget(value, device)  # e.g. the body of a no-grad region
            attributes[str(node.target)] = value
        elif node in members and node.op != "output":
            if node.op == "call_module":
                target = str(node.target)
                attributes[target] = _resolve(root, captured.graph_module, target)
            env[node] = graph.node_copy(node, lambda n: env[n])
            if device is not None:
                _point_at(env[node], device)
    if stage == plan.num_stages - 1:
        output_node = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
        graph.output(fx.map_arg(output_node.args[0], lambda n: env[n]))
    else:
        graph.output(tuple(env[n] for n in plan.crossing[stage]))
    module = StageModule(attributes, graph, class_name=f"Stage{stage}")
    _keep_non_persistent(module, root, attributes)
    module.stage_index = stage
    module.input_names = input_names
    module.num_received = len(received)
    return module


def _check_not_meta_constant(root: nn.Module, target: str, value: object, stage: int) -> None:
    """A tensor the capture made (not a parameter or buffer of the model) on the meta device
    has no value, and never will: fail at the build, naming it, not when the stage moves."""
    if not isinstance(value, torch.Tensor) or not value.is_meta:
        return
    try:
        _attribute(root, target)
        return  # the model's own meta tensor: param_init_fn materialises it
    except AttributeError:
        pass
    raise PipelineTraceError(
        f"stage {stage} needs {target!r} (shape {tuple(value.shape)}), a tensor constant the "
        f"capture created on the meta device: the model's forward makes a tensor on a meta "
        f"parameter's device, so its value was never computed (Hugging Face transformers "
        f"before 5.20.2 does so). Capture a model with real parameters, or upgrade transformers"
    )


def _keep_non_persistent(module: nn.Module, root: nn.Module, attributes: dict[str, object]) -> None:
    """``fx.GraphModule`` registers every tensor attribute as a persistent buffer; a buffer the
    model leaves out of its ``state_dict`` (Llama's ``rotary_emb.inv_freq``) stays out of the
    stage's too, under its original name."""
    for target, value in attributes.items():
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue
        path, _, field = target.rpartition(".")
        try:
            owner = root.get_submodule(path)
        except AttributeError:  # a constant of the captured graph, not the model's
            continue
        if field in owner._non_persistent_buffers_set:
            module.get_submodule(path)._non_persistent_buffers_set.add(field)


_META = torch.device("meta")


def _point_at(node: fx.Node, device: torch.device) -> bool:
    """Replace ``device=meta`` (keyword or positional) in ``node``'s arguments; True if any."""

    def swap(value: fx.node.Argument) -> fx.node.Argument:
        return device if isinstance(value, torch.device) and value == _META else value

    args = fx.node.map_aggregate(node.args, swap)
    kwargs = fx.node.map_aggregate(node.kwargs, swap)
    changed = args != node.args or kwargs != node.kwargs
    if changed:
        node.args, node.kwargs = args, kwargs
    return changed


def _retarget(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of a captured subgraph whose ``meta`` device arguments point at ``device``."""
    module = copy.deepcopy(module)
    for node in module.graph.nodes:
        _point_at(node, device)
        if node.op == "get_attr":
            inner = getattr(module, str(node.target), None)
            if isinstance(inner, fx.GraphModule):
                setattr(module, str(node.target), _retarget(inner, device))
    module.recompile()
    return module


class StageModule(fx.GraphModule):
    """One pipeline stage: ``forward(*received_values, *model_inputs)``."""

    stage_index: int
    input_names: list[str]
    num_received: int


def _is_embedding_lookup(node: fx.Node, module: object) -> bool:
    if isinstance(module, nn.Module):
        return isinstance(module, nn.Embedding) or type(module).__name__ == "ParallelEmbedding"
    name = getattr(node.target, "__name__", None) or str(node.target)
    return "embedding" in name and "backward" not in name


def node_costs(captured: CapturedGraph, root: nn.Module) -> list[int]:
    """Estimated compute of every node, in graph order: the parameters it multiplies.

    A layer's FLOPs per token are ~2x the weights it multiplies (forward; backward ~2x that),
    so each use of a parameter by a node costs its numel: a tied weight is charged at every
    use (the LM head's matmul), an embedding lookup nothing (it gathers rows and multiplies
    nothing). Work that holds no parameters (attention's T^2 term, norms, the loss) is left
    out: identical layers carry the same share of it, so balancing ignores it.
    """
    costs = []
    for node in captured.graph_module.graph.nodes:
        params: list[torch.Tensor] = []
        module: object = None
        if node.op == "call_module":
            module = _resolve(root, captured.graph_module, str(node.target))
            if isinstance(module, nn.Module):
                params = list(module.parameters())
        for dep in node.all_input_nodes:
            if dep.op == "get_attr":
                obj = _resolve(root, captured.graph_module, str(dep.target))
                if isinstance(obj, nn.Parameter):
                    params.append(obj)
        costs.append(0 if _is_embedding_lookup(node, module) else sum(p.numel() for p in params))
    return costs


def auto_pipeline_cuts(
    captured: CapturedGraph,
    root: nn.Module,
    layer_names: Sequence[str],
    num_stages: int,
) -> list[str]:
    """Cut after the layers that best balance estimated compute (:func:`node_costs`).

    Not parameter count: an embedding holds many parameters and costs almost nothing, a tied
    LM head holds none of its own and costs as much as its matmul. A cut after layer ``L``
    leaves the prefix cost up to ``L``'s last node on the left; for stage boundary k the layer
    whose prefix is closest to ``k/S`` of the total is chosen (strictly increasing).
    """
    if len(layer_names) < num_stages - 1:
        raise ValueError(
            f"auto_partition needs at least {num_stages - 1} transformer layers to cut after "
            f"for {num_stages} stages, found {len(layer_names)}: {list(layer_names)}"
        )
    prefix, running = [], 0
    for cost in node_costs(captured, root):
        running += cost
        prefix.append(running)
    positions = cut_positions(captured, layer_names)
    order = sorted(zip(positions, layer_names))
    total = prefix[-1]
    cuts: list[str] = []
    last = -1
    for k in range(1, num_stages):
        remaining = num_stages - 1 - k  # cuts still to place after this one
        choices = [
            (abs(prefix[pos] - k * total / num_stages), i)
            for i, (pos, _) in enumerate(order)
            if i > last and i < len(order) - remaining
        ]
        _, best = min(choices)
        cuts.append(order[best][1])
        last = best
    logger.info("auto_partition cuts %s (compute balance)", cuts)
    return cuts
