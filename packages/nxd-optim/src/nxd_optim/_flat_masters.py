"""fp32 master weights of bf16/fp16 params, held flat: θ32 and ∇θ32 are views of one buffer each.

For the bf16/fp16 params p_1 … p_k added together (at construction, or by one
``add_param_group``) that live on one device, with n_i elements each:

    M = [vec(θ32_1), …, vec(θ32_k)]          θ32_i = M[o_i : o_i + n_i], p_i's shape
    G = [vec(∇θ32_j) for p_j trainable]      θ32_j.grad = G[o'_j : o'_j + n_j], persistent

(trainable: ``requires_grad`` when added). The wrapped optimizer still gets one tensor per
param (θ32_i), so any ``torch.optim`` optimizer, its param groups, per-group hyper-parameters
and foreach / fused kernels work unchanged, and its state stays keyed by θ32_i. One step:

    G <- float32(g)          one multi-tensor copy (none where G is the fp32 accumulation
                             buffer: ``use_fp32_grad_acc`` accumulates into these views)
    θ32 <- inner.step(θ32)   the ∇θ32 views stay attached between steps
    θ <- round(θ32)          one multi-tensor copy

Resident: M (4 bytes per bf16/fp16 param, as before) and G (4 bytes per trainable bf16/fp16
param). G replaces the fp32 gradients the step used to allocate per param and free at
``zero_grad``, so the step's peak is unchanged; between steps G now stays (with fp32
accumulation it is the accumulation buffer itself and adds nothing). A param unfrozen after
it was added has no view in G: its master gets a new fp32 gradient per step, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nxd_layers import copy_tensor_model_parallel_attributes
from nxd_optim._grad_sync import copy_expert_attributes
from nxd_optim._mixed_precision import is_low_precision

__all__ = ["FlatMasters"]


def _flat_views(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Views, of each tensor's shape, into one new zero-filled flat fp32 buffer on ``device``."""
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float32, device=device)
    views, start = [], 0
    for tensor in tensors:
        views.append(flat[start : start + tensor.numel()].view(tensor.shape))
        start += tensor.numel()
    return views


@dataclass(frozen=True)
class _StepPlan:
    """What :meth:`FlatMasters.gradients` does for one list of trainable params; made when the
    list changes (first step, ``requires_grad`` flipped, ``add_param_group``)."""

    key: tuple[int, ...]
    """``id`` of each trainable param, in order."""
    targets: list[torch.Tensor]
    """Per trainable param, the tensor the wrapped optimizer steps: its master, or itself."""
    copy_positions: list[int]
    """Positions whose gradient is cast into ``copy_into`` (one multi-tensor copy)."""
    copy_into: list[torch.Tensor]
    """The persistent ∇θ32 views those gradients go to."""
    cast_positions: list[int]
    """Positions whose target gets a new gradient of its dtype every step (no view to fill)."""
    attached: list[tuple[torch.Tensor, torch.Tensor]]
    """(master, its ∇θ32 view) for every trainable param with a view."""


class FlatMasters:
    """fp32 masters of bf16/fp16 params and their gradients as views of flat buffers (see the
    module docstring), and the per-step gradient hand-over to the wrapped optimizer."""

    def __init__(self) -> None:
        self._master: dict[torch.Tensor, torch.Tensor] = {}
        self._grad: dict[torch.Tensor, torch.Tensor] = {}
        self._params: list[torch.Tensor] = []
        self._masters: list[torch.Tensor] = []
        self._without_view: list[torch.Tensor] = []
        self._plan: _StepPlan | None = None

    def add(self, params: Sequence[torch.Tensor]) -> None:
        """θ32 for every bf16/fp16 param of ``params`` not seen before (one flat fp32 buffer per
        device, float32 copies of the params, TP and expert attributes copied), and ∇θ32 for
        those that require grad (another flat buffer per device, zeros)."""
        new = [p for p in dict.fromkeys(params) if is_low_precision(p.dtype)]
        new = [p for p in new if p not in self._master]
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for param in new:
            by_device.setdefault(param.device, []).append(param)
        masters: dict[torch.Tensor, torch.Tensor] = {}
        for device, group in by_device.items():
            views = _flat_views(group, device)
            torch._foreach_copy_(views, [p.detach() for p in group])
            masters.update(zip(group, views, strict=True))
            trainable = [p for p in group if p.requires_grad]
            if trainable:
                self._grad.update(zip(trainable, _flat_views(trainable, device), strict=True))
        for param in new:  # in the order given: the order of master_weights_by_param()
            master = masters[param]
            copy_tensor_model_parallel_attributes(master, param)
            copy_expert_attributes(master, param)  # the norm sums experts over EP
            self._master[param] = master
        self._params, self._masters = list(self._master), list(self._master.values())
        self._without_view = [m for p, m in self._master.items() if p not in self._grad]
        self._plan = None

    def by_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{param: θ32}`` in the order the params were added (a new dict)."""
        return dict(self._master)

    def gradient_views(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{param: its ∇θ32 view}``: where fp32 accumulation may sum that param's gradients,
        so the step has nothing to copy (zeros until then)."""
        return dict(self._grad)

    def gradients(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Hand the gradients ``grads`` of the trainable ``params`` (same order, reduced) to
        the tensors the wrapped optimizer steps, and return those tensors.

        A param with a master and a ∇θ32 view: the gradient is cast into the view (all of them
        in one multi-tensor copy), unless it is the view (fp32 accumulation); the view is
        re-attached if someone detached it (``inner.zero_grad()``). A master without a view, or
        a param stepped in place whose gradient is not ``p.grad`` (fp32 accumulation without
        masters): a new gradient of the target's dtype. Masters of params not in ``params``
        (frozen) have no gradient, so the wrapped optimizer leaves them alone.
        """
        key = tuple(map(id, params))
        plan = self._plan
        if plan is None or plan.key != key:
            plan = self._plan = self._make_plan(key, params, grads)
        if plan.copy_into:
            torch._foreach_copy_(plan.copy_into, [grads[i] for i in plan.copy_positions])
        for i in plan.cast_positions:
            target = plan.targets[i]
            target.grad = grads[i].to(target.dtype)
        for master, view in plan.attached:
            if master.grad is not view:
                master.grad = view
        return plan.targets

    def _make_plan(
        self, key: tuple[int, ...], params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> _StepPlan:
        """Sort the trainable params by what their gradient needs (see :meth:`gradients`), and
        detach the gradients of masters whose param is frozen."""
        targets: list[torch.Tensor] = []
        copy_positions: list[int] = []
        copy_into: list[torch.Tensor] = []
        cast_positions: list[int] = []
        attached: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            master, view = self._master.get(param), self._grad.get(param)
            targets.append(param if master is None else master)
            if master is not None and view is not None:
                attached.append((master, view))
                if grad is not view:
                    copy_positions.append(i)
                    copy_into.append(view)
            elif master is not None or grad is not param.grad:
                cast_positions.append(i)
        trainable = set(key)
        for param, master in self._master.items():
            if id(param) not in trainable:
                master.grad = None
        return _StepPlan(key, targets, copy_positions, copy_into, cast_positions, attached)

    def release_gradients(self) -> None:
        """``zero_grad``: drop the per-step gradients of masters without a ∇θ32 view; the views
        stay attached (the next step overwrites or accumulates into them)."""
        for master in self._without_view:
            master.grad = None

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """θ <- round(θ32) for every master: one multi-tensor copy."""
        if self._masters:
            torch._foreach_copy_(self._params, self._masters)
