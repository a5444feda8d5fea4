"""A model's tensors as this rank holds them: name, local tensor and shard spec.

Names are state-dict names of the *original* model (``NxDPPModel`` stages keep them), so a
checkpoint saved under pipeline parallelism is a union of the stages' names. A model that
describes its own checkpoint state (the protocol of :mod:`nxd_state.shards`) says which
tensors it holds; nxd-ckpt never asks what class it is. Tied weights
(one tensor under several names on a rank) are stored once; the other names become aliases.
A plain ``dict`` of tensors is accepted too (NxD allows it); without sharding attributes its
tensors are saved per (TP, PP) rank and load back at the same degrees only.

A module declaring ``nxd_checkpoint_parts`` (:mod:`nxd_ckpt.parts`) has those parameters
stored under the declared names: :meth:`LocalTensor.stored` is what a save writes,
:meth:`LocalTensor.stored_in` what a load reads from a checkpoint holding given names.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nxd_ckpt.layout._context import RankContext
from nxd_ckpt.parts import CHECKPOINT_PARTS, StoredPart
from nxd_layers.checkpoint_shards import module_checkpoint_tensors, tensor_shard_spec
from nxd_state.shards import CheckpointState, ShardSpec, part_spec, rank_local_spec

__all__ = [
    "LocalTensor",
    "Part",
    "declared_parts",
    "model_tensors",
]


@dataclass
class Part:
    """A stored part of a local tensor: its full stored name, spec and older names."""

    name: str
    spec: ShardSpec
    aliases: tuple[str, ...] = ()


@dataclass
class LocalTensor:
    """A tensor of the model on this rank: its own (state-dict) name and spec, and the stored
    parts its module declares (None: stored under its own name)."""

    name: str
    tensor: torch.Tensor
    spec: ShardSpec
    parts: list[Part] | None = field(default=None)
    owner: Any = None
    """The module holding it (:attr:`nxd_state.shards.CheckpointTensor.owner`), if known."""

    def stored(self) -> list[tuple[str, ShardSpec]]:
        """(stored name, spec) of what a save writes for this tensor."""
        if self.parts is None:
            return [(self.name, self.spec)]
        return [(part.name, part.spec) for part in self.parts]

    def stored_in(self, names: Container[str]) -> list[tuple[str, ShardSpec]]:
        """What to read from a checkpoint holding ``names``: the parts (each under its name or
        an alias); else the tensor's own name (a checkpoint written before the parts were
        declared); else the parts, which the caller reports missing."""
        if self.parts is None:
            return [(self.name, self.spec)]
        chosen = []
        for part in self.parts:
            found = next((n for n in (part.name, *part.aliases) if n in names), None)
            if found is None:
                break
            chosen.append((found, part.spec))
        else:
            return chosen
        if self.name in names:
            return [(self.name, self.spec)]
        return self.stored()


def _sibling(prefix: str, name: str) -> str:
    """``name`` relative to the parent of the module at ``prefix``."""
    parent = prefix.rpartition(".")[0]
    return f"{parent}.{name}" if parent else name


def declared_parts(
    module: nn.Module | None, prefix: str, local: str, spec: ShardSpec
) -> list[Part] | None:
    """The stored parts ``module`` (at ``prefix``) declares for its tensor ``local``, with
    their specs cut from ``spec`` (:func:`nxd_state.shards.part_spec`); None if none."""
    declared = getattr(module, CHECKPOINT_PARTS, None) if module is not None else None
    if not declared or local not in declared:
        return None
    what = f"{prefix}.{local}" if prefix else local
    listed = tuple(declared[local])
    parts = tuple(p for p in listed if isinstance(p, StoredPart))
    if not parts or len(parts) != len(listed):
        raise TypeError(
            f"{what}: {CHECKPOINT_PARTS} must map it to a non-empty tuple of "
            f"nxd_ckpt.StoredPart, got {listed!r}"
        )
    total = spec.global_shape[0] if spec.global_shape else 0
    counts = [p.rows for p in parts]
    if len(parts) == 1 and counts[0] is None:
        rows = [total]
    else:
        rows = [count for count in counts if count is not None]
        if len(rows) != len(counts) or sum(rows) != total:
            raise ValueError(
                f"{what}: declared parts of {[p.rows for p in parts]} rows do not add up to "
                f"its global tensor's {total} rows (shape {spec.global_shape})"
            )
    out, start = [], 0
    for part, count in zip(parts, rows):
        cut = part_spec(spec, start, count, what)
        cut.info["stored_part_of"] = {"name": what, "row_offset": start}
        aliases = tuple(_sibling(prefix, a) for a in part.aliases)
        out.append(Part(_sibling(prefix, part.name), cut, aliases))
        start += count
    return out


def model_tensors(
    model: Any, ctx: RankContext, *, for_load: bool = False
) -> tuple[list[LocalTensor], dict[str, str]]:
    """Every tensor of ``model`` on this rank (state-dict names) and the aliases of tied ones.

    A model that describes its own checkpoint state (:class:`nxd_state.shards.CheckpointState`:
    a pipeline model's local stages, a LoRA model's save mode) is asked for it; ``for_load``:
    the tensors to fill (e.g. LoRA's base weights, not merged copies). Any other module is
    walked by its layers' sharding attributes (:func:`nxd_layers.module_checkpoint_tensors`).
    Stored parts apply where a tensor's owning module declares them."""
    if isinstance(model, Mapping):
        return _dict_tensors(model, ctx), {}
    if isinstance(model, CheckpointState):
        described = model.checkpoint_tensors(ctx, for_load=for_load)
    elif isinstance(model, nn.Module):
        described = module_checkpoint_tensors([model], ctx)
    else:
        raise TypeError(
            f"model must be a torch.nn.Module (NxDPPModel included) or a dict of tensors, "
            f"got {type(model).__name__}"
        )
    out = []
    for tensor in described.tensors:
        prefix, _, local = tensor.name.rpartition(".")
        parts = declared_parts(tensor.owner, prefix, local, tensor.spec)
        out.append(LocalTensor(tensor.name, tensor.tensor, tensor.spec, parts, tensor.owner))
    return out, dict(described.aliases)


def _dict_tensors(state: Mapping[str, Any], ctx: RankContext) -> list[LocalTensor]:
    out = []
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"model state dict entry {name!r} is a {type(value).__name__}, not a tensor"
            )
        marked = getattr(value, "tensor_model_parallel", None) is not None or getattr(
            value, "expert_model_parallel", False
        )
        if marked or (ctx.tp_size == 1 and ctx.pp_size == 1):  # unmarked: it is global
            spec = tensor_shard_spec(
                value,
                tp_rank=ctx.tp_rank,
                tp_size=ctx.tp_size,
                ep_rank=ctx.ep_rank,
                ep_size=ctx.ep_size,
                local_name=name,
            )
        else:
            spec = rank_local_spec(value)
        out.append(LocalTensor(name, value, spec))
    return out
