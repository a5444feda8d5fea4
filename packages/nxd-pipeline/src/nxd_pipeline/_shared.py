"""Weights used by layers on several pipeline ranks, in the manual partition mode.

A weight ``W`` used by layers on stages held by different ranks exists once per rank. Each
copy starts from the lowest holding rank's value, and after every step each copy's gradient
becomes ``sum_r dL/dW_r`` (:mod:`nxd_pipeline._reduce`), so every copy takes the same optimizer
step as the single tied weight of one process would.
Two layer parameters are one weight when they are the same ``Parameter`` object or when
:func:`mark_weight_sharing` put them in one group (NxD's API, for copies that are separate
tensors, e.g. after moving to a device).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SharedWeight", "mark_weight_sharing", "shared_weights"]

WEIGHT_SHARING_ATTR = "weight_sharing"
"""Attribute (NxD's name) a marked layer carries: ``{group name: parameter path}``."""


def mark_weight_sharing(
    layer_and_weight_path: Sequence[tuple[nn.Module, str]], sharing_group_name: str = "default"
) -> None:
    """Mark weights of several layers as one (NxD's ``PipelineStageModule.mark_weight_sharing``).

    ``[(layers[0], "weight"), (layers[-1], "weight")]``: the layers may end up on different
    pipeline ranks; the weight starts from the lowest rank's value and its gradient is the sum
    of every use. Call before building ``NxDPPModel``.
    """
    shape = None
    for layer, path in layer_and_weight_path:
        weight = operator.attrgetter(path)(layer)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"mark_weight_sharing: {type(layer).__name__}.{path} is a "
                f"{type(weight).__name__}, not a tensor"
            )
        if shape is not None and tuple(weight.shape) != shape:
            raise ValueError(
                f"mark_weight_sharing group {sharing_group_name!r}: {type(layer).__name__}.{path} "
                f"has shape {tuple(weight.shape)}, the group's first weight {shape}"
            )
        shape = tuple(weight.shape)
        marks = layer.__dict__.setdefault(WEIGHT_SHARING_ATTR, {})
        if sharing_group_name in marks:
            raise RuntimeError(
                f"weight sharing group {sharing_group_name!r} is already marked on this "
                f"{type(layer).__name__} (as {marks[sharing_group_name]!r})"
            )
        marks[sharing_group_name] = path


Slot = tuple[int, str]
"""A layer parameter: (layer index, parameter path in the layer)."""


@dataclass(frozen=True)
class SharedWeight:
    """A weight used by layers on several pipeline ranks."""

    group: str
    """NxD's sharing group name, or ``"tied:<layer>.<path>"`` for a shared ``Parameter``."""
    stages: tuple[int, ...]
    """Stages holding it."""
    local: nn.Parameter | None
    """This rank's copy (None if no local stage uses it)."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def shared_weights(
    layers: Sequence[nn.Module], stage_of: Sequence[int], p: int, rank: int
) -> list[SharedWeight]:
    """Weights shared across pipeline ranks, in the same order on every rank.

    Layer parameters are grouped when they are the same object or marked with one group name;
    groups whose layers all sit on one rank need nothing (autograd sums the uses).
    """
    slots: dict[Slot, nn.Parameter] = {}
    for i, layer in enumerate(layers):
        for path, param in layer.named_parameters(remove_duplicate=False):
            slots[(i, path)] = param
    groups, names = _sharing_groups(layers, slots)
    out = []
    for head, members in sorted(groups.items()):
        stages = tuple(sorted({stage_of[i] for i, _ in members}))
        if len({s % p for s in stages}) < 2:
            continue
        local = {id(slots[m]): slots[m] for m in members if stage_of[m[0]] % p == rank}
        if len(local) > 1:
            where = sorted(f"{i}.{path}" for i, path in members if stage_of[i] % p == rank)
            raise ValueError(
                f"{where} share a weight and sit on pipeline rank {rank}, but are different "
                f"tensors: tie them on one rank (layer.weight = other_layer.weight)"
            )
        group = next((names[m] for m in members if m in names), f"tied:{head[0]}.{head[1]}")
        param = slots[head]
        out.append(
            SharedWeight(
                group=group,
                stages=stages,
                local=next(iter(local.values()), None),
                shape=tuple(param.shape),
                dtype=param.dtype,
            )
        )
    return out


def _sharing_groups(
    layers: Sequence[nn.Module], slots: dict[Slot, nn.Parameter]
) -> tuple[dict[Slot, list[Slot]], dict[Slot, str]]:
    """The slots (layer index, parameter path) joined into groups, by union-find: those holding
    the same ``Parameter``, and those marked with one group name (:func:`mark_weight_sharing`).
    Returns each group's members under its smallest slot, and the group name of marked slots."""
    parent = {slot: slot for slot in slots}

    def root(slot: Slot) -> Slot:
        while parent[slot] != slot:
            slot = parent[slot]
        return slot

    def join(a: Slot, b: Slot) -> None:
        ra, rb = root(a), root(b)
        parent[max(ra, rb)] = min(ra, rb)

    first_use: dict[int, Slot] = {}
    for slot, param in slots.items():
        join(first_use.setdefault(id(param), slot), slot)
    names: dict[Slot, str] = {}
    marked: dict[str, Slot] = {}
    for i, layer in enumerate(layers):
        for group, path in getattr(layer, WEIGHT_SHARING_ATTR, {}).items():
            if (i, path) not in slots:
                raise ValueError(
                    f"weight sharing group {group!r} marks {path!r} of layer {i} "
                    f"({type(layer).__name__}), which is not one of its parameters"
                )
            join(marked.setdefault(group, (i, path)), (i, path))
            names[(i, path)] = group
    groups: dict[Slot, list[Slot]] = {}
    for slot in slots:
        groups.setdefault(root(slot), []).append(slot)
    return groups, names
