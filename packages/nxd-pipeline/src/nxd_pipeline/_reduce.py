"""Gradient reductions of a training step: tied weights over the pipeline, all over DP.

A ``run_train`` call produces gradients ``g`` on each rank. Weights held by several pipeline
ranks (tied embeddings) need ``Σ_PP g`` on every copy, and, unless an optimizer wrapper or
ZeRO-1 does it at its step, every gradient is averaged over the n = DP x CP data-parallel
ranks:

    R(g) = (1/n) Σ_DP Σ_PP g          (Σ_PP only for tied weights)

Expert weights at expert parallelism EP > 1 (``expert_model_parallel``, set by
``nxd_layers.moe``): the EP ranks of a DP group hold different experts, and the all-to-all
backward has already summed into ``g_e`` the gradient of every token of the EP group. The
ranks holding the same experts (the expert-DP group, n / EP ranks) together saw each token
once, so the global batch's mean-loss gradient is

    R(g_e) = (1/n) Σ_expert-DP g_e    (= (1/EP) mean_expert-DP g_e)

the scale of ``nxd_optim.NxDOptimizer`` and ``nxd_layers.bucket_allreduce_gradients``, so the
pipeline's reduction and the optimizer's give the same update.

Each call reduces exactly what it produced and adds the result to what ``.grad`` already held:
``G <- G + R(g_c)``. After k calls, ``G = Σ_c R(g_c) = R(Σ_c g_c)`` (R is linear): gradient
accumulation over calls equals one call on all the batches. Reducing ``G`` itself would sum the
earlier calls' tied-weight gradients over the pipeline again (a micro-step counted twice).

How: a post-accumulate-grad hook on each reduced parameter, registered when the local
parameters are final (so before an optimizer's own hooks), moves each new gradient out of
``.grad`` into a per-call buffer while a call runs; afterwards the buffers are reduced and
delivered with a backward from the parameter itself, through autograd's ``AccumulateGrad``:
``.grad`` grows by ``R(g_c)`` and hooks registered later (an optimizer's fp32 gradient
accumulation, which frees ``.grad``) see the reduced gradient once, as if autograd made it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from nxd_state import collectives

__all__ = [
    "DataParallelReduction",
    "GradientReducer",
    "TiedWeight",
    "is_expert",
    "sync_tied_weights",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TiedWeight:
    """A weight whose copies sit on several pipeline ranks."""

    name: str | None
    """This rank's local name for it (None: no local stage uses it)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    first_rank: int
    """The lowest pipeline rank holding a copy: its value is the one every copy starts from."""


@dataclass(frozen=True)
class DataParallelReduction:
    """Where a step's gradients are averaged: ``g <- (1/size) Σ_group g`` for dense weights,
    ``g_e <- (1/size) Σ_expert_group g_e`` for expert weights (see the module docstring)."""

    group: ProcessGroup
    """DP x CP: the replicas of this rank's slice (the DP group when CP = 1)."""
    size: int
    """n = DP x CP, the divisor of both sums."""
    expert_group: ProcessGroup | None = None
    """The expert-DP group (the ranks holding this rank's experts) at EP > 1; None at EP = 1,
    where expert weights are replicated over DP and reduced as dense ones."""


def is_expert(param: torch.Tensor) -> bool:
    """True for an expert weight of ``nxd_layers.moe`` (marked ``expert_model_parallel``)."""
    return bool(getattr(param, "expert_model_parallel", False))


def _locals(tied: Sequence[TiedWeight], params: dict[str, nn.Parameter]) -> list:
    return [params.get(w.name) if w.name is not None else None for w in tied]


def sync_tied_weights(
    tied: Sequence[TiedWeight],
    params: dict[str, nn.Parameter],
    rank: int,
    group: ProcessGroup | None,
    device: torch.device,
) -> None:
    """Give every copy the lowest holding rank's value (NxD's initial sync): one all-reduce
    per weight where only that rank contributes."""
    for weight, local in zip(tied, _locals(tied, params)):
        value = torch.zeros(weight.shape, dtype=weight.dtype, device=device)
        if local is not None and weight.first_rank == rank:
            value.copy_(local.detach())
        collectives.all_reduce(value, group=group)
        if local is not None:
            with torch.no_grad():
                local.copy_(value)


class GradientReducer:
    """Reduces each ``run_train`` call's own gradients (see the module docstring).

    ``tied``: the tied weights (in the same order on every pipeline rank), summed over
    ``pipeline_group``; ``params``: the local parameters under every name. Before each call,
    :meth:`configure` says whether every local gradient is then averaged over the
    data-parallel groups (a :class:`DataParallelReduction`; the flags may change between
    calls, and parameters may be added, e.g. adapters).
    """

    def __init__(
        self,
        *,
        params: dict[str, nn.Parameter],
        tied: Sequence[TiedWeight],
        pipeline_group: ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.tied = list(tied)
        self.tied_locals = _locals(self.tied, params)
        self.pipeline_group = pipeline_group
        self.reduction: DataParallelReduction | None = None
        self.device = device
        self.params: list[nn.Parameter] = []
        self._current: set[int] = set()
        self._hooked: set[int] = set()
        self._fresh: dict[nn.Parameter, torch.Tensor] = {}
        self._saved: dict[nn.Parameter, torch.Tensor | None] = {}
        self._active = False
        self.configure(params, None)

    def configure(
        self, params: dict[str, nn.Parameter], reduction: DataParallelReduction | None
    ) -> None:
        """The parameters this call reduces: the tied ones, and all of ``params`` when
        ``reduction`` averages them over data parallelism. Hooks are registered once per
        parameter, the first time it is reduced (at construction for the model's own: before
        an optimizer's)."""
        self.reduction = reduction
        wanted = [p for p in self.tied_locals if p is not None]
        if reduction is not None:
            wanted += list(params.values())
        self.params = [p for p in dict.fromkeys(wanted) if p.requires_grad]
        self._current = {id(p) for p in self.params}
        for param in self.params:
            if id(param) not in self._hooked:
                param.register_post_accumulate_grad_hook(self._capture)
                self._hooked.add(id(param))

    def _capture(self, param: torch.Tensor) -> None:
        if not self._active or param.grad is None or id(param) not in self._current:
            return
        fresh = self._fresh.get(param)  # type: ignore[call-overload]
        if fresh is None:
            self._fresh[param] = param.grad  # type: ignore[index]
        else:
            fresh.add_(param.grad)
        param.grad = None

    def begin(self) -> None:
        """Before a call's backwards: set the accumulated gradients aside."""
        self._saved = {p: p.grad for p in self.params}
        for param in self.params:
            param.grad = None
        self._fresh = {}
        self._active = True

    def abort(self) -> None:
        """The call failed: put the accumulated gradients back, drop this call's."""
        self._active = False
        for param, grad in self._saved.items():
            param.grad = grad
        self._saved, self._fresh = {}, {}

    def finish(self) -> None:
        """Reduce this call's gradients and add them to the accumulated ones."""
        self._active = False
        fresh = self._fresh
        for weight, local in zip(self.tied, self.tied_locals):  # Σ_PP, zeros where unused
            grad = fresh.get(local) if local is not None else None
            if grad is None:
                grad = torch.zeros(weight.shape, dtype=weight.dtype, device=self.device)
            collectives.all_reduce(grad, group=self.pipeline_group)
            if local is not None and local.requires_grad:
                fresh[local] = grad
        if self.reduction is not None:
            self._average(fresh)
        for param, grad in self._saved.items():
            param.grad = grad
        self._saved, self._fresh = {}, {}
        delivered = [p for p in self.params if p in fresh]
        if delivered:  # through AccumulateGrad: .grad += R(g); later hooks see it
            torch.autograd.backward(delivered, [fresh[p] for p in delivered])

    def _average(self, fresh: dict[nn.Parameter, torch.Tensor]) -> None:
        """Dense: ``(1/n) Σ_DPxCP g``; experts at EP > 1: ``(1/n) Σ_expert-DP g_e``. Every DP
        rank runs the same graph, so the same parameters got gradients, in the same order."""
        reduction = self.reduction
        assert reduction is not None
        grads = [(p, fresh[p]) for p in self.params if p in fresh]
        split = reduction.expert_group is not None
        dense = [g for p, g in grads if not (split and is_expert(p))]
        experts = [g for p, g in grads if split and is_expert(p)]
        collectives.all_reduce_bucketed(dense, reduction.group, average=True)
        if experts:
            assert reduction.expert_group is not None
            collectives.all_reduce_bucketed(experts, reduction.expert_group, average=False)
            torch._foreach_div_(experts, float(reduction.size))
