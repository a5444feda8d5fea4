"""Sequence parallelism for a family parallelised by its tensor-parallel plan.

Between the first decoder layer and the LM head each TP rank holds ``S/t`` of the ``S``
tokens (the sequence dimension is 1, batch first). Only per-token work may run on such a
slice; the sharded blocks (attention, MLP) see the whole sequence::

    x_r                    (B, S/t, H)   rank r's slice, in the decoder layers and the norms
    X = gather_r(x_r)      (B, S, H)     a block's input (backward: this rank's slice of dX)
    Y_r = X A_r            column-parallel, local heads/features (backward: dX summed over TP)
    y_r = scatter_r(Σ_q Y_q B_q)         row-parallel reduce-scatter back to (B, S/t, H)

so the family's own block forward, which shapes its heads by its input's sequence length,
sees what it sees at TP alone. The norms between the blocks (in each layer, and the final
one after the stack) act per token: their gradients are partial sums, marked to be summed
over TP. :func:`sequence_parallel_modules` refuses (:class:`UnsupportedModelError`) any model
where that would not be exact: experts kept whole, a block without row-parallel outputs, a
module with parameters outside the blocks that is not a norm, a model-level norm not applied
after the decoder stack.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nxd_trainer.hf._rules import ModelPlan, UnsupportedModelError, _source, module_list_at

__all__ = [
    "gather_sequence",
    "on_first_input",
    "scatter_sequence",
    "sequence_parallel_modules",
]


def _is_norm(module: nn.Module) -> bool:
    """A leaf module named a norm whose parameters are vectors: it acts per token."""
    return (
        "norm" in type(module).__name__.lower()
        and not any(True for _ in module.children())
        and all(p.dim() == 1 for p in module.parameters())
    )


def _check_blocks(plan: ModelPlan, family: str, layers: str) -> None:
    if plan.replicated:
        raise UnsupportedModelError(
            family,
            f"sequence parallelism with MoE experts kept whole over TP ({plan.replicated[0]}) "
            f"is not supported; use expert parallelism, or turn sequence parallelism off",
        )
    for block in plan.blocks:
        if not (block.path.startswith(layers + ".") and block.columns and block.rows):
            raise UnsupportedModelError(
                family,
                f"sequence parallelism needs every sharded block inside the decoder layers, "
                f"entered by column-parallel and left by row-parallel layers (whose output "
                f"is reduce-scattered back to the split sequence); {block.path} is not "
                f"(columns {sorted(block.columns)}, rows {sorted(block.rows)})",
            )


def _layer_norms(model: nn.Module, family: str, plan: ModelPlan, layers: str) -> list[str]:
    """The modules with parameters in the decoder layers outside the sharded blocks, each a
    norm (else refused)."""
    blocks = [b.path for b in plan.blocks]
    found = []
    for name, module in model.get_submodule(layers).named_modules(prefix=layers):
        inside = any(name == b or name.startswith(b + ".") for b in blocks)
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if inside or not own:
            continue
        if not _is_norm(module):
            raise UnsupportedModelError(
                family,
                f"sequence parallelism: {name} ({type(module).__name__}) holds parameters "
                f"outside the sharded blocks and is not a per-token norm; it would see "
                f"1/TP of the sequence",
            )
        found.append(name)
    return found


def _final_norms(model: nn.Module, family: str, plan: ModelPlan, layers: str) -> list[str]:
    """The model-level modules with parameters besides the embedding, head and stack: norms
    the stack's parent applies after the stack, once (read from its forward's source)."""
    parent_path, _, stack = layers.rpartition(".")
    parent = model.get_submodule(parent_path)
    source = _source(type(parent).forward)
    stack_at = source.find(f"self.{stack}")
    found = []
    for name, module in model.named_modules():
        skip = (layers, plan.embed, plan.lm_head)
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        attr = name.rpartition(".")[2]
        call = f"self.{attr}("
        after = stack_at >= 0 and source.count(call) == 1 and source.find(call) > stack_at
        if not (_is_norm(module) and name.rpartition(".")[0] == parent_path and after):
            raise UnsupportedModelError(
                family,
                f"sequence parallelism: {name} ({type(module).__name__}) holds parameters "
                f"outside the decoder layers and is not a norm applied once after them; "
                f"nxd cannot tell which part of the sequence it sees",
            )
        found.append(name)
    return found


def sequence_parallel_modules(
    model: nn.Module, family: str, plan: ModelPlan, layers: str
) -> list[str]:
    """The modules whose parameters act on this rank's slice of the sequence (their
    gradients summed over TP), after checking the model allows sequence parallelism (see the
    module docstring)."""
    if module_list_at(model, layers) is None:
        raise UnsupportedModelError(
            family,
            f"sequence parallelism needs the decoder layers as a module list at {layers} "
            f"(where transformers' pipeline plan, or the default, puts them)",
        )
    _check_blocks(plan, family, layers)
    return _layer_norms(model, family, plan, layers) + _final_norms(model, family, plan, layers)


def on_first_input(
    module: nn.Module, transform: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs=True``) applying ``transform`` to ``module``'s
    activation input: its forward's first argument, given by position or by name."""
    first = next(iter(inspect.signature(module.forward).parameters))

    def hook(called: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (transform(args[0]), *args[1:]), kwargs
        if first not in kwargs:
            raise TypeError(
                f"{type(called).__name__} was called without its activation input {first!r}"
            )
        return args, {**kwargs, first: transform(kwargs[first])}

    return hook


def scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the sequence (dim 1); backward: the slices gathered."""
    from nxd_layers.mappings import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(x, 1)


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """The whole sequence (dim 1) where every rank's consumer is whole (a replicated head, a
    block whose column-parallel layers sum their input gradients over TP); backward: this
    rank's slice of the gradient."""
    from nxd_layers.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, 1, to_model_parallel=False)
