"""Stage backward passes: full (B), and split into input gradient (I) and weight gradient (W).

For stage outputs ``Y = f(X; θ)`` and incoming ``dL/dY``:

* B computes ``dL/dX`` and accumulates ``dL/dθ`` in one autograd pass;
* I computes only ``dL/dX`` (what the previous stage waits for). On the way it records, at each
  autograd node where a parameter's branch leaves the X-path, the gradient flowing into that
  node;
* W later replays only the parameter branches from those recorded gradients, giving ``dL/dθ``
  without redoing the X-path. A parameter used several times in the stage (tied inside one
  stage) gets its gradient in I instead, where one pass sums every use exactly once.

The first stage has no X (its inputs are token ids). There the "X-path" is every node from
which two or more parameters are reachable (the activation path through the layers), and a
parameter's branch is what only it depends on (``x^T dY`` of its linear layer, the embedding
lookup's scatter): I runs the activation backward through the whole stage, as on any other
stage, and W the parameter tails, so I and W cost about half of B each instead of 0 and B.

Zero-bubble scheduling (ZB-H1) runs W in what would otherwise be pipeline bubbles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGradState", "backward_full", "backward_input", "backward_weight"]


def _grad_node(tensor: torch.Tensor) -> Node:
    """The autograd node receiving ``tensor``'s gradient (its AccumulateGrad for leaves)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    view = tensor.view_as(tensor)
    assert view.grad_fn is not None, "tensor does not require grad"
    node = view.grad_fn.next_functions[0][0]
    assert node is not None  # a leaf's view has the leaf's AccumulateGrad as its input
    return node


def _ones_if_none(roots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> list[Any]:
    return [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]


def _deliver(params: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """``p.grad += g`` through autograd's ``AccumulateGrad`` (a backward from the parameter
    itself), exactly as a plain backward would accumulate it: gradient hooks on the
    parameters (an optimizer's fp32 accumulation, the pipeline's reductions) run."""
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
    if pairs:
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


def backward_full(
    roots: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """B: accumulate parameter gradients and return ``dL/dX`` for each of ``inputs``."""
    if roots:
        torch.autograd.backward(roots, _ones_if_none(roots, grads))
    return [x.grad for x in inputs]


@dataclass
class WeightGradState:
    """What I leaves for W: recorded gradients at the parameter branches."""

    branches: list[tuple[list[torch.Tensor], list[tuple[Node, list[torch.Tensor | None]]]]] = field(
        default_factory=list
    )
    """(parameters, [(branch node, gradient flowing into it), ...]): parameters sharing the same
    branch nodes (a linear layer's weight and bias) are differentiated together."""


def backward_input(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    inputs: list[torch.Tensor],
    params: list[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradState]:
    """I: ``dL/dX`` for ``inputs`` now; what W needs for ``params`` later."""
    grads = _ones_if_none(roots, grads)
    params = [p for p in params if p.requires_grad]
    state = WeightGradState()
    if not roots:
        return [None for _ in inputs], state
    parents, slots, seen = _graph_towards_outputs(roots)
    param_nodes = {id(p): _grad_node(p) for p in params}
    x_path = (
        _ancestors_of_any([_grad_node(x) for x in inputs], parents)
        if inputs
        else _ancestors_of_two([param_nodes[id(p)] for p in params], parents, seen)
    )
    root_nodes = {_grad_node(r) for r in roots}
    in_i_pass: list[torch.Tensor] = []
    per_param: list[tuple[torch.Tensor, set[Node]]] = []
    for param in params:
        node = param_nodes[id(param)]
        if node not in seen:
            continue  # unused by this microbatch
        branch = _branch_point(node, parents, x_path, root_nodes)
        if branch is None:
            in_i_pass.append(param)
        else:
            per_param.append((param, branch))
    points = {n for _, branch in per_param for n in branch}
    if inputs:  # branch points lie on the input path: record what flows into them
        recorded = _input_pass(roots, grads, [*inputs, *in_i_pass], points)
        input_grads: list[torch.Tensor | None] = [x.grad for x in inputs]
    else:  # first stage: the branch points' incoming gradients are the outputs of I
        recorded = _first_stage_pass(roots, grads, in_i_pass, points, slots)
        input_grads = []
    groups: dict[frozenset[Node], list[torch.Tensor]] = {}
    for param, branch in per_param:
        groups.setdefault(frozenset(branch), []).append(param)
    for shared, group in groups.items():
        state.branches.append((group, [(n, recorded.get(n, [])) for n in shared]))
    return input_grads, state


def _graph_towards_outputs(
    roots: list[torch.Tensor],
) -> tuple[dict[Node, list[Node]], dict[Node, set[int]], set[Node]]:
    """The autograd graph from the roots: the parents (towards the outputs) of every node,
    the input slots of each node that receive a gradient, and every node reached."""
    parents: dict[Node, list[Node]] = {}
    slots: dict[Node, set[int]] = {}
    queue = deque({_grad_node(r) for r in roots})
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, slot in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            slots.setdefault(child, set()).add(slot)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents, slots, seen


def _branch_point(
    node: Node, parents: dict[Node, list[Node]], x_path: set[Node], root_nodes: set[Node]
) -> set[Node] | None:
    """Where a parameter's branch (from its ``node`` up) joins the X-path, as a one-node set;
    None when its gradient belongs in I: it is used more than once (one pass sums every use
    exactly once), reaches an output without crossing the X-path, or joins the X-path at
    several nodes (one may lie below another, so replaying both in W would count a path
    twice)."""
    if len(parents.get(node, [])) > 1:
        return None
    branch_points: set[Node] = set()
    queue, visited = deque([node]), {node}
    while queue:
        current = queue.popleft()
        if current in root_nodes and current not in x_path:
            return None
        for parent in parents.get(current, []):
            if parent in visited:
                continue
            visited.add(parent)
            if parent in x_path:
                branch_points.add(parent)
            else:
                queue.append(parent)
    return branch_points if len(branch_points) == 1 else None


def _input_pass(
    roots: list[torch.Tensor],
    grads: list[Any],
    wanted: list[torch.Tensor],
    points: set[Node],
) -> dict[Node, list[torch.Tensor | None]]:
    """One backward to ``wanted`` (the stage inputs and the parameters done in I; their
    ``.grad`` accumulates, the parameters' through AccumulateGrad), recording the gradient
    flowing into each branch point on the way."""
    recorded: dict[Node, list[torch.Tensor | None]] = {}
    handles = []
    for node in points:

        def hook(grad_outputs: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
            recorded[node] = list(grad_outputs)

        handles.append(node.register_prehook(hook))
    try:
        torch.autograd.backward(roots, grads, retain_graph=True, inputs=wanted or None)
    finally:
        for handle in handles:
            handle.remove()
    return recorded


def _first_stage_pass(
    roots: list[torch.Tensor],
    grads: list[Any],
    in_i_pass: list[torch.Tensor],
    points: set[Node],
    slots: dict[Node, set[int]],
) -> dict[Node, list[torch.Tensor | None]]:
    """The first stage's I: the gradients into the branch points' slots are its outputs
    (there is no X to differentiate towards); the parameters done in I get theirs too."""
    recorded: dict[Node, list[torch.Tensor | None]] = {}
    edges = [(n, slot) for n in points for slot in sorted(slots.get(n, ()))]
    wanted = in_i_pass + [GradientEdge(n, slot) for n, slot in edges]
    result = (
        # torch's stub takes tensors or GradientEdges, not a list mixing both (autograd does)
        torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)  # type: ignore[arg-type]
        if wanted
        else ()
    )
    for (node, slot), grad in zip(edges, result[len(in_i_pass) :]):
        node_grads = recorded.setdefault(node, [])
        node_grads += [None] * (slot + 1 - len(node_grads))
        node_grads[slot] = grad
    _deliver(in_i_pass, result[: len(in_i_pass)])
    return recorded


def _ancestors_of_any(nodes: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """Nodes from which one of ``nodes`` is reachable (not counting ``nodes`` themselves)."""
    found: set[Node] = set()
    queue = deque(nodes)
    while queue:
        node = queue.popleft()
        for parent in parents.get(node, []):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


def _ancestors_of_two(
    nodes: list[Node], parents: dict[Node, list[Node]], graph: set[Node]
) -> set[Node]:
    """Nodes from which two or more distinct ``nodes`` are reachable.

    One upward walk per node, counting visits; a walk stops where the count is already two,
    since every ancestor of such a node was counted twice by the walks that got it there.
    """
    count: dict[Node, int] = {}
    for start in dict.fromkeys(n for n in nodes if n in graph):
        queue, visited = deque([start]), {start}
        while queue:
            for parent in parents.get(queue.popleft(), []):
                if parent in visited or count.get(parent, 0) >= 2:
                    continue
                visited.add(parent)
                count[parent] = count.get(parent, 0) + 1
                queue.append(parent)
    return {n for n, c in count.items() if c >= 2}


def backward_weight(state: WeightGradState) -> None:
    """W: accumulate the parameter gradients that :func:`backward_input` deferred.

    Two kinds of branch are computed directly from their node's saved tensors, and all of
    them accumulated in one autograd call: a linear layer (``addmm(b, X, Wᵀ)`` or
    ``mm(X, Wᵀ)`` with the weight behind one transpose: ``dW = α dYᵀ X``, ``db = β Σ_rows dY``)
    and a layer norm (``native_layer_norm(X, γ, β)``: ``dγ = Σ_rows dY ⊙ (X - μ) σ⁻¹``,
    ``dβ = Σ_rows dY``, through ``aten.native_layer_norm_backward`` with only those two
    outputs, the kernel a full backward runs). A linear layer whose parameters already hold
    a ``.grad`` and have no gradient hooks (a later microbatch, no DP capture or optimizer
    hook) accumulates in place instead, ``G_W <- G_W + α dYᵀ X`` in one ``addmm_``: what
    AccumulateGrad's ``G += g`` does, without the temporary ``g`` (the temporaries of a whole
    stage, alive together, and their extra pass over memory made W cost as much as B on a
    CPU). Any other branch is replayed by the autograd
    engine, one call per group: each call walks the whole graph below its node, ~1-1.5 ms a
    group on one CPU core whatever the model's width, W's fixed cost beyond its arithmetic.
    """
    direct: list[tuple[list[torch.Tensor], Node, torch.Tensor]] = []
    for group, branches in state.branches:
        if _direct_branch(group, branches):
            node, grads = branches[0]
            assert grads[0] is not None
            if node.name() != _LAYER_NORM and _accumulates_in_place(group):
                _add_linear_grads_in_place(node, grads[0])
            else:
                direct.append((group, node, grads[0]))
            continue
        edges, grads = [], []
        for node, node_grads in branches:
            for index, grad in enumerate(node_grads):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        if edges:  # accumulates through AccumulateGrad, as a plain backward does
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=group)
    if direct:  # one autograd call; the gradients are made inside it, so AccumulateGrad
        params = [p for group, _, _ in direct for p in group]  # can take them without a copy
        with torch.enable_grad():
            root = _DirectWeightGrads.apply(direct, *params)
        torch.autograd.backward(root)
    state.branches.clear()


def _direct_branch(
    group: list[torch.Tensor], branches: list[tuple[Node, list[torch.Tensor | None]]]
) -> bool:
    """Whether W computes ``group``'s gradients itself: a linear or layer-norm branch."""
    return _is_linear_branch(group, branches) or _is_layer_norm_branch(group, branches)


class _DirectWeightGrads(torch.autograd.Function):
    """Backward-only: returns the direct branches' parameter gradients (made in ``backward``,
    so nothing else holds them when AccumulateGrad receives them)."""

    @staticmethod
    def forward(
        ctx: Any, direct: list[tuple[list[torch.Tensor], Node, torch.Tensor]], *params: Any
    ) -> torch.Tensor:
        ctx.direct = direct
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = [None]
        for group, node, grad in ctx.direct:
            if node.name() == _LAYER_NORM:
                out += _layer_norm_grads(group, node, grad)
            else:
                out += _linear_grads(group, node, grad)
        ctx.direct = None
        return tuple(out)


def _accumulated_variable(node: Node | None) -> torch.Tensor | None:
    """The leaf an ``AccumulateGrad`` node accumulates into; None for any other node."""
    if node is None or node.name() != "torch::autograd::AccumulateGrad":
        return None
    return node.variable  # type: ignore[attr-defined]


def _linear_operands(node: Node) -> tuple[Any, Any, Any, Node | None, torch.Tensor | None]:
    """(X, α, β, the node behind Wᵀ, bias) of an ``addmm`` / ``mm`` node."""
    edges = [edge for edge, _ in node.next_functions]
    if node.name() == "AddmmBackward0":  # addmm(self=bias, mat1=X, mat2=Wᵀ, beta, alpha)
        saved = (node._saved_mat1, node._saved_alpha, node._saved_beta)  # type: ignore[attr-defined]
        return (*saved, edges[2], _accumulated_variable(edges[0]))
    return node._saved_self, 1, 1, edges[1], None  # type: ignore[attr-defined]  # mm(X, Wᵀ)


def _is_linear_branch(
    group: list[torch.Tensor], branches: list[tuple[Node, list[torch.Tensor | None]]]
) -> bool:
    """Whether ``group``'s branch is one linear layer's GEMM node: ``addmm(b, X, Wᵀ)`` or
    ``mm(X, Wᵀ)`` with the weight (and bias) leaves right behind it, 2-d, one dtype."""
    if len(branches) != 1:
        return False
    node, node_grads = branches[0]
    if node.name() not in ("AddmmBackward0", "MmBackward0") or len(node_grads) != 1:
        return False
    grad = node_grads[0]
    x, _, _, transpose, bias = _linear_operands(node)
    if transpose is None or transpose.name() != "TBackward0":
        return False
    weight = _accumulated_variable(transpose.next_functions[0][0])
    expected = [weight] if bias is None else [weight, bias]
    return not (
        grad is None
        or weight is None
        or {id(t) for t in group} != {id(t) for t in expected}
        or len(group) != len(expected)
        or grad.dim() != 2
        or x.dim() != 2
        or x.layout != torch.strided
        or not grad.dtype == x.dtype == weight.dtype
        or weight.shape != (grad.shape[1], x.shape[1])
        or (bias is not None and (bias.shape != (grad.shape[1],) or bias.dtype != grad.dtype))
    )


def _linear_grads(group: list[torch.Tensor], node: Node, grad: torch.Tensor) -> list[torch.Tensor]:
    """``dW = α dYᵀ X`` and ``db = β Σ_rows dY``, in ``group``'s order."""
    x, alpha, beta, transpose, bias = _linear_operands(node)
    assert transpose is not None
    weight = _accumulated_variable(transpose.next_functions[0][0])
    weight_grad = grad.t().mm(x)
    by_id = {id(weight): weight_grad * alpha if alpha != 1 else weight_grad}
    if bias is not None:
        bias_grad = grad.sum(0)
        by_id[id(bias)] = bias_grad * beta if beta != 1 else bias_grad
    return [by_id[id(t)] for t in group]


_LAYER_NORM = "NativeLayerNormBackward0"


def _layer_norm_params(node: Node) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(γ, β) leaves right behind a ``native_layer_norm`` node (None where absent)."""
    edges = [edge for edge, _ in node.next_functions]
    return _accumulated_variable(edges[1]), _accumulated_variable(edges[2])


def _is_layer_norm_branch(
    group: list[torch.Tensor], branches: list[tuple[Node, list[torch.Tensor | None]]]
) -> bool:
    """Whether ``group``'s branch is one layer norm's node with its affine parameters (the
    leaves right behind it, all of them in ``group``) and one recorded output gradient."""
    if len(branches) != 1:
        return False
    node, node_grads = branches[0]
    if node.name() != _LAYER_NORM or len(node_grads) != 1 or node_grads[0] is None:
        return False
    present = [t for t in _layer_norm_params(node) if t is not None]
    grad = node_grads[0]
    return (
        bool(present)
        and {id(t) for t in group} == {id(t) for t in present}
        and len(group) == len(present)
        and grad.shape == node._saved_input.shape  # type: ignore[attr-defined]
        and grad.layout == torch.strided
    )


def _layer_norm_grads(
    group: list[torch.Tensor], node: Node, grad: torch.Tensor
) -> list[torch.Tensor]:
    """``dγ`` and ``dβ`` of a layer norm from its saved input, mean and 1/σ, in ``group``'s
    order (the full backward's kernel, asked for those two outputs only)."""
    weight, bias = _layer_norm_params(node)
    saved: Any = node
    _, weight_grad, bias_grad = torch.ops.aten.native_layer_norm_backward(
        grad,
        saved._saved_input,
        saved._saved_normalized_shape,
        saved._saved_result1,  # mean
        saved._saved_result2,  # 1/σ
        saved._saved_weight,
        saved._saved_bias,
        [False, weight is not None, bias is not None],
    )
    by_id = {id(weight): weight_grad, id(bias): bias_grad}
    return [by_id[id(t)] for t in group]


def _accumulates_in_place(group: list[torch.Tensor]) -> bool:
    """Whether W may add ``group``'s gradients straight into ``.grad``: each parameter has a
    dense ``.grad`` like itself, and no tensor or post-accumulate-grad hook that must see the
    new gradient through AccumulateGrad (hooks registered on the AccumulateGrad node itself,
    from C++, are not visible here; nxd's own use ``register_post_accumulate_grad_hook``)."""
    for param in group:
        grad = param.grad
        if (
            grad is None
            or grad.requires_grad
            or grad.layout != torch.strided
            or grad.dtype != param.dtype
            or grad.device != param.device
            or grad.shape != param.shape
            or not grad.is_contiguous()
            or getattr(param, "_post_accumulate_grad_hooks", None)
            or getattr(param, "_backward_hooks", None)
        ):
            return False
    return True


@torch.no_grad()
def _add_linear_grads_in_place(node: Node, grad: torch.Tensor) -> None:
    """``G_W += α dYᵀ X`` (one GEMM with β = 1) and ``G_b += β Σ_rows dY``."""
    x, alpha, beta, transpose, bias = _linear_operands(node)
    assert transpose is not None
    weight = _accumulated_variable(transpose.next_functions[0][0])
    assert weight is not None
    assert weight.grad is not None
    weight.grad.addmm_(grad.t(), x, alpha=alpha)
    if bias is not None:
        assert bias.grad is not None
        bias.grad.add_(grad.sum(0), alpha=beta)
