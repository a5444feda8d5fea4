"""Gradient norm and clipping over sharded parameters; sequence-parallel and DP gradient sums.

||g||_p = (sum over every distinct element e of the full model of |g_e|^p)^(1/p). Each rank
adds its TP-sharded gradients (divided by ``tensor_parallel_replicas`` when K/V replicas hold
the same element several times) and its TP-replicated gradients once per TP group, then sums
over the groups that hold disjoint parts of the model: TP and PP, plus the ZeRO-1 sharding
group when the gradients are ZeRO-1 shards. ``p = inf`` takes maxima instead. Parameters
marked ``shared`` (a tied copy counted elsewhere) are left out of the norm but clipped.

Which groups are reduced over (NxD's rules, with nxd's explicit groups on top):

* no group keyword (NxD's call): the current state's TP group and, when PP > 1, its PP group;
* ``zero1_optimizer=True`` without ``zero1_optimizer_groups``: the whole world (every rank
  holds a disjoint shard);
* ``zero1_optimizer_groups``: TP and PP as above, then the ZeRO-1 sharding group, given as
  NxD's replica groups (``get_data_parallel_group(as_list=True)``) or a ProcessGroup;
* any of ``tensor_parallel_group`` / ``pipeline_parallel_group`` / ``data_parallel_group``:
  exactly the groups passed (TP still defaults to the current state's).

Expert parallelism: parameters marked ``expert_model_parallel`` (the experts of
:mod:`nxd_layers.moe`) hold disjoint experts on the ranks of the EP group, so when the current
state has EP > 1 their share of ``||g||_p^p`` is first summed (max for inf) over the EP group,
then added to the rest. Under ZeRO-1 arguments (``zero1_optimizer``) such parameters are
refused: this function cannot tell which shard of an expert a ZeRO-1 rank holds;
``nxd_optim.NeuronEPZero1Optimizer`` measures its own norm with each expert counted once.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from nxd_state import collectives, get_parallel_state, model_parallel_is_initialized

__all__ = [
    "allreduce_sequence_parallel_gradients",
    "bucket_allreduce_gradients",
    "clip_grad_norm",
    "clip_grads_with_norm",
    "get_grad_norm",
    "param_is_not_shared",
    "tensor_norms",
]

logger = logging.getLogger(__name__)

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does.
_CLIP_EPS = 1e-6
# NxD's DP all-reduce bucket (ALLREDUCE_BUCKET_CAP_MB, default 512 MB).
_BUCKET_CAP_MB = 512

ReplicaGroups = Sequence[Sequence[int]]


def _as_list(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _parse_norm_type(norm_type: float | int | str) -> float:
    value = float(norm_type)  # accepts "inf"
    if math.isnan(value) or value <= 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return value


def _default_tp_group(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is not None:
        return group
    if model_parallel_is_initialized():
        return get_parallel_state().tensor_parallel_group
    return None


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a parameter marked ``shared`` (a tied copy whose gradient is counted
    elsewhere)."""
    return not getattr(param, "shared", False)


def _resolve_replica_groups(groups: ReplicaGroups | ProcessGroup) -> ProcessGroup | None:
    """The ProcessGroup of this rank for NxD's replica groups (lists of global ranks), found
    among the current state's groups; None when every group is a single rank."""
    if isinstance(groups, ProcessGroup):
        return groups
    wanted = sorted(sorted(int(r) for r in g) for g in groups)
    if all(len(g) == 1 for g in wanted):
        return None
    world = dist.get_world_size()
    if wanted == [list(range(world))]:
        return dist.GroupMember.WORLD
    if model_parallel_is_initialized():
        state = get_parallel_state()
        layout = state.layout
        for family, group in (
            (layout.data_parallel_groups(), state.data_parallel_group),
            (layout.tensor_parallel_groups(), state.tensor_parallel_group),
            (layout.pipeline_parallel_groups(), state.pipeline_parallel_group),
            (layout.model_parallel_groups(), state.model_parallel_group),
        ):
            if wanted == sorted(sorted(g) for g in family):
                return group
    raise ValueError(
        f"zero1_optimizer_groups {[list(g) for g in groups]} match none of the current parallel "
        "state's groups (data, tensor, pipeline, model parallel or the world); pass a "
        "torch.distributed ProcessGroup instead"
    )


@dataclass
class _Reduction:
    """The TP group used to count replicated gradients once, and the groups summed over."""

    tp_group: ProcessGroup | None
    groups: Sequence[ProcessGroup | None] = field(default_factory=list)  # None: default group


def _plan(
    zero1_optimizer: bool,
    zero1_optimizer_groups: ReplicaGroups | ProcessGroup | None,
    tensor_parallel_group: ProcessGroup | None,
    pipeline_parallel_group: ProcessGroup | None,
    data_parallel_group: ProcessGroup | None,
) -> _Reduction:
    """Raise on contradictory arguments (on every rank, before any collective); see the module
    docstring for the rules."""
    if zero1_optimizer_groups is not None and not zero1_optimizer:
        raise ValueError(
            "zero1_optimizer_groups was given with zero1_optimizer=False: the groups are the "
            "ZeRO-1 sharding groups, pass zero1_optimizer=True"
        )
    explicit = any(
        g is not None for g in (tensor_parallel_group, pipeline_parallel_group, data_parallel_group)
    )
    tp_group = _default_tp_group(tensor_parallel_group)
    if zero1_optimizer and zero1_optimizer_groups is None:
        if explicit:
            raise ValueError(
                "zero1_optimizer=True without zero1_optimizer_groups reduces over the whole "
                "world; do not also pass tensor/pipeline/data_parallel_group"
            )
        return _Reduction(tp_group, [dist.GroupMember.WORLD])
    if zero1_optimizer_groups is not None and data_parallel_group is not None:
        raise ValueError(
            "zero1_optimizer_groups and data_parallel_group both name the group that holds "
            "disjoint gradient shards; pass one of them"
        )
    pp_group = pipeline_parallel_group
    if not explicit and model_parallel_is_initialized():
        state = get_parallel_state()
        pp_group = state.pipeline_parallel_group if state.pipeline_parallel_size > 1 else None
    shard_group = data_parallel_group
    if zero1_optimizer_groups is not None:
        shard_group = _resolve_replica_groups(zero1_optimizer_groups)
    groups = [g for g in (tp_group, pp_group, shard_group) if g is not None]
    return _Reduction(tp_group, groups)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and lower precision, float64 for float64 (no narrowing)."""
    return torch.promote_types(dtype, torch.float32)


def tensor_norms(tensors: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """(||t_1||_p, ..., ||t_k||_p) for non-empty tensors of one device and dtype, as a 1-D
    tensor in the accumulation dtype (float32, float64 for float64).

    Sums of |t|^p are accumulated in float32 whatever the tensors' dtype: one
    ``torch._foreach_norm`` call (one fused kernel on CUDA, which reads bfloat16 and
    accumulates in float32 in registers). For p = inf the norm max |t| is a value of the
    tensor, exact in its own dtype: it is taken there (no conversion), on CPU as
    max(max t, -min t) from ``torch.aminmax``, one vectorised pass, where torch's CPU
    ``vector_norm(inf)`` takes an elementwise path about 20 times slower; NaN propagates.
    """
    dtype = _accumulation_dtype(tensors[0].dtype)
    if p == math.inf:
        if tensors[0].device.type == "cpu":
            bounds = [torch.aminmax(t) for t in tensors]
            highs = torch.stack([b.max for b in bounds])
            lows = torch.stack([b.min for b in bounds])
            return torch.maximum(highs, lows.neg()).to(dtype)
        return torch.stack(torch._foreach_norm(list(tensors), p)).to(dtype)
    if tensors[0].dtype == dtype:  # same kernel as dtype=dtype, without the argument
        return torch.stack(torch._foreach_norm(list(tensors), p))
    return torch.stack(torch._foreach_norm(list(tensors), p, dtype=dtype))


def _local_norm_power(
    params: list[torch.Tensor],
    p: float,
    tp_rank: int,
    tp_size: int,
    force_spmd: bool,
    device: torch.device,
) -> torch.Tensor:
    """This rank's share of ||g||_p^p (of max |g| for p = inf), a float32 scalar on ``device``.

    sum_i w_i ||g_i||_p^p with w_i = (1 / tp_size for TP-replicated gradients under
    ``force_spmd``) / (K/V replica count). Gradients are grouped by (device, dtype, w_i) and
    each group's per-tensor norms come from :func:`tensor_norms` (one foreach call per
    group), accumulated in float32 (float64 for float64 gradients); then
    sum_i w_i ||g_i||^p = w · ||(||g_1||, ..., ||g_k||)||_p^p per group. A fused QKV weight
    with per-row replica counts takes row norms (``vector_norm`` over dim 1).
    """
    inf = p == math.inf
    total = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype, float], list[torch.Tensor]] = {}
    for param in params:
        if not param_is_not_shared(param):
            continue
        weight = 1.0
        if not getattr(param, "tensor_model_parallel", False):
            if inf or force_spmd:
                weight = 1.0 / tp_size
            elif tp_rank != 0:
                continue
        assert param.grad is not None  # the caller passes only parameters with a gradient
        grad = param.grad.detach()
        if grad.numel() == 0:  # no elements: adds nothing (and inf has no identity)
            continue
        replicas = getattr(param, "tensor_parallel_replicas", 1)
        if inf:
            weight = 1.0  # a maximum: copies and replicas do not change it
        elif isinstance(replicas, torch.Tensor):  # per-row copy counts (fused QKV)
            rows = torch.linalg.vector_norm(
                grad.reshape(replicas.numel(), -1),
                p,
                dim=1,
                dtype=_accumulation_dtype(grad.dtype),
            )
            share = (rows.pow(p) / replicas.to(rows.device, rows.dtype)).sum() * weight
            total = total + share.to(device, torch.float32)
            continue
        else:
            weight /= replicas
        groups.setdefault((grad.device, grad.dtype, weight), []).append(grad)
    for (_, _, weight), grads in groups.items():
        norms = tensor_norms(grads, p)
        if inf:
            total = torch.maximum(total, norms.max().to(device, torch.float32))
        else:
            total = total + (norms.pow(p).sum() * weight).to(device, torch.float32)
    return total


def get_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float | int | str = 2,
    zero1_optimizer: bool = False,
    zero1_optimizer_groups: ReplicaGroups | ProcessGroup | None = None,
    force_spmd: bool = True,
    *,
    tensor_parallel_group: ProcessGroup | None = None,
    pipeline_parallel_group: ProcessGroup | None = None,
    data_parallel_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """||g||_p over the full (unsharded) model, as a float32 scalar on the gradients' device.

    ``force_spmd`` (NxD's): TP-replicated gradients are added on every TP rank and divided by
    the TP size (True) or added on TP rank 0 only (False); the norm is the same either way.
    See the module docstring for the groups reduced over.
    """
    p = _parse_norm_type(norm_type)
    plan = _plan(
        zero1_optimizer,
        zero1_optimizer_groups,
        tensor_parallel_group,
        pipeline_parallel_group,
        data_parallel_group,
    )
    params = [param for param in _as_list(parameters) if param.grad is not None]
    tp_group = plan.tp_group
    tp_rank = collectives.group_rank(tp_group) if tp_group is not None else 0
    tp_size = collectives.group_size(tp_group) if tp_group is not None else 1
    first_grad = params[0].grad if params else None
    device = first_grad.device if first_grad is not None else torch.device("cpu")
    op = ReduceOp.MAX if p == math.inf else ReduceOp.SUM
    ep_group = _expert_parallel_group(zero1_optimizer or zero1_optimizer_groups is not None)
    if ep_group is None:
        total = _local_norm_power(params, p, tp_rank, tp_size, force_spmd, device)
    else:
        experts = [q for q in params if getattr(q, "expert_model_parallel", False)]
        others = [q for q in params if not getattr(q, "expert_model_parallel", False)]
        total = _local_norm_power(others, p, tp_rank, tp_size, force_spmd, device)
        expert_total = _local_norm_power(experts, p, tp_rank, tp_size, force_spmd, device)
        collectives.all_reduce(expert_total, group=ep_group, op=op)
        total = torch.maximum(total, expert_total) if p == math.inf else total + expert_total
    for group in plan.groups:
        collectives.all_reduce(total, group=group, op=op)
    return total if p == math.inf else total.pow(1.0 / p)


def _expert_parallel_group(zero1: bool) -> ProcessGroup | None:
    """The current state's EP group when EP > 1, else None; ZeRO-1 with EP > 1 is refused."""
    if not model_parallel_is_initialized():
        return None
    state = get_parallel_state()
    if state.expert_model_parallel_size == 1:
        return None
    if zero1:
        raise NotImplementedError(
            f"gradient norm under ZeRO-1 with expert_model_parallel_size="
            f"{state.expert_model_parallel_size}: expert shards of ZeRO-1 are not known here; "
            f"use nxd_optim.NeuronEPZero1Optimizer, which measures its own norm"
        )
    return state.expert_model_parallel_group


def clip_grads_with_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    total_norm: torch.Tensor,
    max_norm: float | int,
) -> torch.Tensor:
    """g <- g * min(1, max_norm / (total_norm + 1e-6)) for every gradient; returns the norm.

    The factor is cast once per (device, dtype) and applied by one ``torch._foreach_mul_``
    per group (the same product as ``g.mul_(factor)`` tensor by tensor). No host sync
    (XLA-friendly): on an accelerator the factor is applied whether or not clipping is
    needed; on CPU, where reading it costs no sync, a factor of exactly 1 (g * 1 = g) is
    skipped.
    """
    clip_coef = torch.clamp(float(max_norm) / (total_norm + _CLIP_EPS), max=1.0)
    if clip_coef.device.type == "cpu" and bool(clip_coef == 1.0):
        return total_norm
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in _as_list(parameters):
        if param.grad is not None:
            grad = param.grad.detach()
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, clip_coef.to(device, dtype))
    return total_norm


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float | int,
    norm_type: float | int | str = 2,
    zero1_optimizer: bool = False,
    zero1_optimizer_groups: ReplicaGroups | ProcessGroup | None = None,
    force_spmd: bool = True,
    *,
    tensor_parallel_group: ProcessGroup | None = None,
    pipeline_parallel_group: ProcessGroup | None = None,
    data_parallel_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """g <- g * min(1, max_norm / (||g||_p + 1e-6)); returns ||g||_p before clipping.

    The norm is that of the full model (:func:`get_grad_norm`, same arguments), so every rank
    scales by the same factor.
    """
    if float(max_norm) < 0 or math.isnan(float(max_norm)):
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    params = _as_list(parameters)
    total_norm = get_grad_norm(
        params,
        norm_type,
        zero1_optimizer,
        zero1_optimizer_groups,
        force_spmd,
        tensor_parallel_group=tensor_parallel_group,
        pipeline_parallel_group=pipeline_parallel_group,
        data_parallel_group=data_parallel_group,
    )
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("gradient norm %.4g, max_norm %s", float(total_norm), max_norm)
    return clip_grads_with_norm(params, total_norm, max_norm)


def _parameters_of(source: Any) -> list[torch.Tensor]:
    """The parameters of an optimizer (its param groups, NxD's argument) or an iterable."""
    if hasattr(source, "param_groups"):
        return [p for group in source.param_groups for p in group["params"]]
    return _as_list(source)


def allreduce_sequence_parallel_gradients(
    parameters: Any, group: ProcessGroup | None = None
) -> None:
    """g <- sum over TP of g, for parameters marked ``sequence_parallel_enabled``.

    ``parameters``: an iterable of parameters, or an optimizer (NxD's argument: its param
    groups). Under sequence parallelism a replicated parameter (a norm weight) sees only this
    rank's sequence shard, so its gradient is partial. The gradient (``main_grad`` when a
    parameter has no ``grad``) is flattened into one buffer per dtype and reduced with one
    all-reduce each.
    """
    tp_group = _default_tp_group(group)
    if tp_group is None:
        raise RuntimeError(
            "allreduce_sequence_parallel_gradients needs a tensor parallel group: pass group= "
            "or call nxd_state.initialize_model_parallel first"
        )
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in _parameters_of(parameters):
        if not getattr(param, "sequence_parallel_enabled", False):
            continue
        grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        collectives.all_reduce_bucketed(grads, tp_group, average=False, bucket_cap_bytes=2**62)


def bucket_allreduce_gradients(
    grads_list: Sequence[torch.Tensor], reduce_over_ep_group: bool = False
) -> None:
    """g <- mean over the data-parallel group of g, in buckets (NxD's DP gradient sync).

    Buckets hold at most ``ALLREDUCE_BUCKET_CAP_MB`` (env, default 512) MB of one dtype, in
    reverse order (last layers first). As in NxD, the caller passes the non-expert gradients
    (averaged over DP x CP) and, separately with ``reduce_over_ep_group=True``, the expert
    gradients: g_e <- (Σ over the expert-DP group of g_e) / (DP x CP). The expert-DP group holds
    the ranks with the same experts; the all-to-all backward of :mod:`nxd_layers.moe` has
    already summed the gradients of every token of the EP group into g_e, so a plain mean over
    expert-DP would be EP times the one-process gradient (the same scale as
    ``nxd_optim.NxDOptimizer``'s; at EP = 1 it is the mean over DP x CP).
    """
    cap = int(os.environ.get("ALLREDUCE_BUCKET_CAP_MB", _BUCKET_CAP_MB)) * 2**20
    state = get_parallel_state()
    grads = list(reversed(list(grads_list)))
    if not reduce_over_ep_group:  # DP x CP: CP ranks are replicas
        group = state.data_context_parallel_group
        collectives.all_reduce_bucketed(grads, group, average=True, bucket_cap_bytes=cap)
        return
    collectives.all_reduce_bucketed(
        grads, state.expert_data_parallel_group, average=False, bucket_cap_bytes=cap
    )
    if grads and state.data_context_parallel_size > 1:
        torch._foreach_div_(grads, float(state.data_context_parallel_size))
