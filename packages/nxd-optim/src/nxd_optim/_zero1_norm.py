"""ZeRO-1's gradient norm: per-slice summaries combined by ``nxd_layers.get_grad_norm``.

The norm of the whole model's gradient, ‖g‖_p = (Σ_e |g_e|^p)^(1/p) with nxd_layers' rules for
tensor parallelism (replicated params counted once, K/V replicas divided out, ``shared`` copies
left out) and the sum over the groups holding disjoint parts. A rank holds its gradient as
slices of params in flat buckets: whole params after an all-reduce, pieces of its shard after
a reduce-scatter.

Every slice s of param i is summarised by one number x_s with |x_s|^p = Σ_{e∈s} |g_e|^p / r_e
(r_e: how many TP replicas hold element e, only where the param has per-row counts; a uniform
count stays an attribute), computed by ``nxd_layers.tensor_norms`` (one foreach call per
device and dtype; the inf norm exact, from ``aminmax`` on CPU). Slices of params
whose attributes are all equal are interchangeable for the rules, so their summaries combine,
(Σ_s |x_s|^p)^(1/p) (max for p = ∞), and reach ``get_grad_norm`` as one one-element gradient
carrying those attributes. get_grad_norm applies its rules to the summaries exactly as to the
slices: the result is the same norm, with one read of each gradient element instead of |g|,
|g|^p and a sum, and a handful of summaries (one per kind of param) instead of one per param.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from nxd_layers import copy_tensor_model_parallel_attributes, get_grad_norm, tensor_norms

__all__ = ["GradSpan", "global_grad_norm"]


@dataclass(frozen=True)
class GradSpan:
    """Elements ``[start, start + grad.numel())`` of vec(param)'s gradient, as a 1-D view."""

    grad: torch.Tensor
    param: torch.Tensor | None  # None: padding only (counts on every TP rank, adds nothing)
    start: int = 0


def _row_replicas(span: GradSpan) -> torch.Tensor | None:
    """Per-element replica counts of the span, for a param with per-row counts."""
    replicas = getattr(span.param, "tensor_parallel_replicas", None)
    if not isinstance(replicas, torch.Tensor) or span.param is None:
        return None
    row = span.param.numel() // replicas.numel()
    index = torch.arange(span.start, span.start + span.grad.numel(), device=span.grad.device)
    return replicas.to(span.grad.device, torch.float32)[index // row]


def _attributes(param: torch.Tensor | None, replicas_folded: bool) -> dict[str, object]:
    """What a summary of ``param``'s slices carries: its TP attributes (as nxd_layers copies
    them) and ``shared``; everything get_grad_norm will see of it."""
    if param is None:  # padding: counted on every TP rank, adds nothing
        return {"tensor_model_parallel": True}
    probe = torch.empty(0)
    copy_tensor_model_parallel_attributes(probe, param)
    attributes = dict(vars(probe))
    if replicas_folded:
        attributes["tensor_parallel_replicas"] = 1
    if getattr(param, "shared", False):  # a tied copy whose gradient is counted elsewhere
        attributes["shared"] = True
    return attributes


def _summary(x: torch.Tensor, attributes: dict[str, object]) -> torch.Tensor:
    """A one-element tensor whose gradient is x, carrying ``attributes``."""
    holder = x.reshape(1)
    summary = holder.detach().clone()
    summary.grad = holder
    for name, value in attributes.items():
        setattr(summary, name, value)
    return summary


def _signature(attributes: dict[str, object]) -> tuple | None:
    """Hashable form of plain-valued attributes (None if any value is not plain: kept apart).
    Slices with equal signatures look the same to get_grad_norm, so they may combine."""
    items = sorted(attributes.items())
    if any(v is not None and not isinstance(v, (bool, int, float, str)) for _, v in items):
        return None
    return tuple(items)


def _summaries(spans: Sequence[GradSpan], p: float) -> list[torch.Tensor]:
    """One summary per group of slices with equal attributes (Σ_s |x_s|^p is the group's
    Σ_e |g_e|^p, max for p = ∞), one per slice with per-row replica counts."""
    weights = [None if p == math.inf else _row_replicas(s) for s in spans]
    plain = [i for i, w in enumerate(weights) if w is None]
    out = []
    if plain:  # one foreach call per (device, dtype), fp32 accumulation (nxd_layers)
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i in plain:
            by_kind.setdefault((spans[i].grad.device, spans[i].grad.dtype), []).append(i)
        norm_of: dict[int, torch.Tensor] = {}
        for members in by_kind.values():
            values = tensor_norms([spans[i].grad for i in members], p).float()
            norm_of.update(zip(members, values.unbind()))
        groups: dict[object, tuple[dict[str, object], list[torch.Tensor]]] = {}
        for i in plain:
            norm = norm_of[i]
            attributes = _attributes(spans[i].param, replicas_folded=False)
            signature = _signature(attributes)
            key = ("alone", i) if signature is None else signature
            groups.setdefault(key, (attributes, []))[1].append(norm)
        for attributes, norms in groups.values():
            combined = torch.linalg.vector_norm(torch.stack(norms), p)
            out.append(_summary(combined, attributes))
    for span, w in zip(spans, weights):
        if w is not None:  # per-row replica counts: fold 1/r_e into the summary
            powered = (span.grad.float().abs().pow(p) / w).sum()
            out.append(_summary(powered.pow(1.0 / p), _attributes(span.param, True)))
    return out


def global_grad_norm(
    spans: Sequence[GradSpan],
    norm_type: float,
    *,
    tensor_parallel_group: ProcessGroup | None,
    pipeline_parallel_group: ProcessGroup | None,
    data_parallel_group: ProcessGroup | None,
) -> torch.Tensor:
    """‖g‖_p over ``spans`` on every rank of the given groups (see the module docstring)."""
    return get_grad_norm(
        _summaries(spans, float(norm_type)),
        norm_type,
        tensor_parallel_group=tensor_parallel_group,
        pipeline_parallel_group=pipeline_parallel_group,
        data_parallel_group=data_parallel_group,
    )
