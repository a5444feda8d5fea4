"""Optimizers for a model that is parallelised after the optimizer was written down.

A training script often creates its optimizer from ``model.parameters()`` before the model is
parallelised; parallelisation replaces those parameters (by shards, on another device, some
on other pipeline ranks). optimum-neuron's two tools:

* :func:`make_optimizer_constructor_lazy`: ``make_optimizer_constructor_lazy(AdamW)(params,
  lr=...)`` records the class, the param groups and the hyper-parameters, touching no
  parameter and creating no state;
* :func:`optimizer_for_mp`: the optimizer over the parallel parameters, from a mapping
  ``id(original parameter) -> parallel parameter`` (:func:`nxd_trainer.hf.parameter_mapping`
  builds it): every group keeps its hyper-parameters, its parameters are replaced, those not
  on this rank (other pipeline stages) are left out. A lazy optimizer gives exactly the intended
  optimizer; a regular one is rebuilt as its class with its groups (its state, if any, is
  not carried over, as in optimum-neuron).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "LazyOptimizer",
    "make_optimizer_constructor_lazy",
    "optimizer_for_mp",
]


class LazyOptimizer(torch.optim.Optimizer):
    """An optimizer recorded, not built: ``optimizer_class``, ``param_groups``, ``defaults``.
    Pass it to :func:`optimizer_for_mp`; stepping it is an error."""

    def __init__(
        self, optimizer_class: type[torch.optim.Optimizer], params: Any, **defaults: Any
    ) -> None:
        self.optimizer_class = optimizer_class
        self.lazy_defaults = dict(defaults)
        super().__init__(params, defaults)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        raise RuntimeError(
            f"this {self.optimizer_class.__name__} is lazy: build the real one with "
            f"optimizer_for_mp(optimizer, parameter_mapping(...)) after parallelising the model"
        )


def make_optimizer_constructor_lazy(
    optimizer_cls: type[torch.optim.Optimizer],
) -> Callable[..., LazyOptimizer]:
    """``optimizer_cls`` as a constructor of :class:`LazyOptimizer` (same arguments)."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}"
        )

    def constructor(params: Iterable[Any], **defaults: Any) -> LazyOptimizer:
        return LazyOptimizer(optimizer_cls, params, **defaults)

    constructor.__name__ = f"lazy_{optimizer_cls.__name__}"
    return constructor


def optimizer_for_mp(
    optimizer: torch.optim.Optimizer,
    orig_param_to_parallel_param_on_xla: Mapping[int, nn.Parameter],
) -> torch.optim.Optimizer:
    """The optimizer for the parallel parameters (see the module docstring)."""
    mapping = orig_param_to_parallel_param_on_xla
    if isinstance(optimizer, LazyOptimizer):
        optimizer_class, defaults = optimizer.optimizer_class, optimizer.lazy_defaults
    else:
        optimizer_class, defaults = type(optimizer), dict(optimizer.defaults)
    groups = []
    placed: dict[int, dict[str, Any]] = {}  # a fused parallel parameter stands for several
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        params = []
        for p in group["params"]:
            parallel = mapping.get(id(p))
            if parallel is None:
                continue
            if id(parallel) in placed:
                if placed[id(parallel)] != hyper:
                    raise ValueError(
                        f"a parallel parameter of shape {tuple(parallel.shape)} stands for "
                        f"original parameters in param groups with different hyper-parameters "
                        f"({placed[id(parallel)]} vs {hyper}): put the Q, K and V projections "
                        f"of an attention layer in one group, or use fuse_qkv=False"
                    )
                continue
            placed[id(parallel)] = hyper
            params.append(parallel)
        if params:
            groups.append({**hyper, "params": params})
    if not groups:
        raise ValueError(
            "none of the optimizer's parameters has a parallel counterpart on this rank: "
            "check the mapping (parameter_mapping(original_parameter_ids(model), parallel))"
        )
    return optimizer_class(groups, **defaults)
