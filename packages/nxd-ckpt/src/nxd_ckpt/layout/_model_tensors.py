"""A model's tensors as this rank holds them: name, local tensor and shard spec.

Names are state-dict names of the *original* model (``NxDPPModel`` stages keep them), so a
checkpoint saved under pipeline parallelism is a union of the stages' names. Tied weights
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
from nxd_ckpt.layout._sharding import ShardSpec, part_spec, rank_local_spec, spec_for_tensor
from nxd_ckpt.parts import CHECKPOINT_PARTS, StoredPart

__all__ = [
    "LocalTensor",
    "Part",
    "declared_parts",
    "is_lora_model",
    "lora_mode",
    "lora_tensors",
    "model_tensors",
    "named_parameters",
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
    their specs cut from ``spec`` (:func:`nxd_ckpt.layout._sharding.part_spec`); None if none."""
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


def is_lora_model(model: Any) -> bool:
    from nxd_lora import LoRAModel

    return isinstance(model, LoRAModel)


def lora_mode(model: Any) -> str:
    config = model.lora_config
    return "adapter" if config.merge_sharded_lora else config.save_mode


def lora_tensors(model: Any, ctx: RankContext, *, for_load: bool = False) -> list[LocalTensor]:
    """The tensors a ``LoRAModel``'s save mode stores (:mod:`nxd_ckpt.lora`), under the
    unwrapped model's names; for ``merged`` the merged weights (when saving) with the base
    parameters' sharding."""
    mode = lora_mode(model)
    modules = dict(model.module.named_modules())
    params = dict(model.module.named_parameters())
    out = []
    for wrapped, tensor in model.module.state_dict(keep_vars=True).items():
        adapter = model.is_adapter_key(wrapped) or (
            wrapped in params and model.is_trainable_name(wrapped)
        )
        if (mode == "adapter" and not adapter) or (
            mode == "merged" and model.is_adapter_key(wrapped)
        ):
            continue
        prefix, _, leaf = wrapped.rpartition(".")
        spec = spec_for_tensor(
            tensor,
            tp_rank=ctx.tp_rank,
            tp_size=ctx.tp_size,
            module=modules.get(prefix),
            local_name=leaf,
            ep_rank=ctx.ep_rank,
            ep_size=ctx.ep_size,
            what=wrapped,
        )
        out.append(LocalTensor(model.original_name(wrapped), tensor, spec))
    if mode == "merged" and not for_load and not model.is_lora_merged:
        by_name = {local.name: local for local in out}
        for lora_name, layer in model.lora_layers().items():
            for param_name, weight in layer.merged_base_weights().items():
                by_name[f"{lora_name}.{param_name}"].tensor = weight
    return out


def _stages(model: Any) -> list[nn.Module]:
    """The modules holding this rank's weights: an NxDPPModel's local stages, else the model."""
    from nxd_pipeline import NxDPPModel

    if isinstance(model, NxDPPModel):
        return list(model.stages.values())
    return [model]


def named_parameters(model: Any) -> list[tuple[str, torch.Tensor]]:
    """This rank's parameters under their original names (each parameter once)."""
    from nxd_pipeline import NxDPPModel

    if isinstance(model, NxDPPModel):
        return list(model.local_named_parameters())
    if isinstance(model, Mapping):
        return [(k, v) for k, v in model.items() if isinstance(v, torch.Tensor)]
    return list(model.named_parameters())


def model_tensors(
    model: Any, ctx: RankContext, *, for_load: bool = False
) -> tuple[list[LocalTensor], dict[str, str]]:
    """Every tensor of ``model`` on this rank (state-dict names) and the aliases of tied ones.

    A LoRA model contributes what its save mode stores (:func:`lora_tensors`); ``for_load``:
    the tensors to fill (the base weights, not merged copies, for the merged mode)."""
    if isinstance(model, Mapping):
        return _dict_tensors(model, ctx), {}
    if is_lora_model(model):
        return lora_tensors(model, ctx, for_load=for_load), {}
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (NxDPPModel included) or a dict of tensors, "
            f"got {type(model).__name__}"
        )
    out: list[LocalTensor] = []
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for stage in _stages(model):
        modules = dict(stage.named_modules())
        for name, tensor in stage.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if id(tensor) in first_name:
                if first_name[id(tensor)] != name:
                    aliases[name] = first_name[id(tensor)]
                continue
            first_name[id(tensor)] = name
            prefix, _, local = name.rpartition(".")
            spec = spec_for_tensor(
                tensor,
                tp_rank=ctx.tp_rank,
                tp_size=ctx.tp_size,
                module=modules.get(prefix),
                local_name=local,
                ep_rank=ctx.ep_rank,
                ep_size=ctx.ep_size,
                what=name,
            )
            parts = declared_parts(modules.get(prefix), prefix, local, spec)
            out.append(LocalTensor(name, tensor, spec, parts))
    return out, aliases


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
            spec = spec_for_tensor(
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
