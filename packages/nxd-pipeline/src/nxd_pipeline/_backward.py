"""Stage backward passes: full (B), and split into input gradient (I) and weight gradient (W).

For stage outputs ``Y = f(X; θ)`` and incoming ``dL/dY``:

* B computes ``dL/dX`` and accumulates ``dL/dθ`` in one autograd pass;
* I computes only ``dL/dX`` (what the previous stage waits for). On the way it records, at each
  autograd node where a parameter's branch leaves the X-path, the gradient flowing into that
  node;
* W later replays only the parameter branches from those recorded gradients, giving ``dL/dθ``
  without redoing the X-path. A parameter used several times in the stage (tied inside one
  stage) gets its gradient in I instead, where one pass sums every use exactly once.

Zero-bubble scheduling (ZB-H1) runs W in what would otherwise be pipeline bubbles.
"""

from __future__ import annotations

from collections import deque
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
    return view.grad_fn.next_functions[0][0]


def _ones_if_none(roots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> list[Any]:
    return [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]


def _accumulate(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.add_(grad)


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
    direct: tuple[list[torch.Tensor], list[Any], list[torch.Tensor]] | None = None
    """(roots, grads, params) to differentiate in full in W (the stage has no input gradient)."""


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
    if not inputs:  # first stage: nothing to hurry for, all of it is weight gradient
        state.direct = (roots, grads, params)
        return [], state
    # Autograd graph from the roots: parents (towards the outputs) of every node.
    parents: dict[Node, list[Node]] = {}
    queue = deque({_grad_node(r) for r in roots})
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    # The X-path: nodes from which some input's gradient is reachable.
    x_path: set[Node] = set()
    queue = deque(_grad_node(x) for x in inputs)
    while queue:
        node = queue.popleft()
        for parent in parents.get(node, []):
            if parent not in x_path:
                x_path.add(parent)
                queue.append(parent)
    param_nodes = {id(p): _grad_node(p) for p in params}
    in_i_pass: list[torch.Tensor] = []
    per_param: list[tuple[torch.Tensor, set[Node]]] = []
    root_nodes = {_grad_node(r) for r in roots}
    for param in params:
        node = param_nodes[id(param)]
        if node not in seen:
            continue  # unused by this microbatch
        if len(parents.get(node, [])) > 1:
            in_i_pass.append(param)  # used more than once: one pass sums every use exactly once
            continue
        branch_points, off_path = set(), False
        queue, visited = deque([node]), {node}
        while queue:
            current = queue.popleft()
            if current in root_nodes and current not in x_path:
                off_path = True
            for parent in parents.get(current, []):
                if parent in visited:
                    continue
                visited.add(parent)
                if parent in x_path:
                    branch_points.add(parent)
                else:
                    queue.append(parent)
        if off_path or not branch_points:
            in_i_pass.append(param)  # reaches an output without crossing the X-path
        else:
            per_param.append((param, branch_points))
    recorded: dict[Node, list[torch.Tensor | None]] = {}
    handles = []
    for node in {n for _, points in per_param for n in points}:

        def hook(grad_outputs: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
            recorded[node] = list(grad_outputs)

        handles.append(node.register_prehook(hook))
    try:
        wanted = list(inputs) + in_i_pass
        result = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for param, grad in zip(in_i_pass, result[len(inputs) :]):
        _accumulate(param, grad)
    groups: dict[frozenset[Node], list[torch.Tensor]] = {}
    for param, points in per_param:
        groups.setdefault(frozenset(points), []).append(param)
    for points, group in groups.items():
        state.branches.append((group, [(n, recorded.get(n, [])) for n in points]))
    return list(result[: len(inputs)]), state


def backward_weight(state: WeightGradState) -> None:
    """W: accumulate the parameter gradients that :func:`backward_input` deferred."""
    if state.direct is not None:
        roots, grads, params = state.direct
        if params:
            result = torch.autograd.grad(roots, params, grads, allow_unused=True)
            for param, grad in zip(params, result):
                _accumulate(param, grad)
    for group, branches in state.branches:
        edges, grads = [], []
        for node, node_grads in branches:
            for index, grad in enumerate(node_grads):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        if edges:
            result = torch.autograd.grad(edges, group, grads, retain_graph=True, allow_unused=True)
            for param, grad in zip(group, result):
                _accumulate(param, grad)
    state.branches.clear()
    state.direct = None
