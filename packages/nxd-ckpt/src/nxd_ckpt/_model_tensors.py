"""A model's tensors as this rank holds them: name, local tensor and shard spec.

Names are state-dict names of the *original* model (``NxDPPModel`` stages keep them), so a
checkpoint saved under pipeline parallelism is a union of the stages' names. Tied weights
(one tensor under several names on a rank) are stored once; the other names become aliases.
A plain ``dict`` of tensors is accepted too (NxD allows it); without sharding attributes its
tensors are saved per (TP, PP) rank and load back at the same degrees only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nxd_ckpt._context import RankContext
from nxd_ckpt._sharding import ShardSpec, rank_local_spec, spec_for_tensor

__all__ = ["LocalTensor", "model_tensors", "named_parameters"]


@dataclass
class LocalTensor:
    name: str
    tensor: torch.Tensor
    spec: ShardSpec


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

    A LoRA model contributes what its save mode stores (:mod:`nxd_ckpt.lora`); ``for_load``:
    the tensors to fill (the base weights, not merged copies, for the merged mode)."""
    if isinstance(model, Mapping):
        return _dict_tensors(model, ctx), {}
    from nxd_ckpt.lora import is_lora_model, lora_tensors

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
            )
            out.append(LocalTensor(name, tensor, spec))
    return out, aliases


def _dict_tensors(state: Mapping[str, Any], ctx: RankContext) -> list[LocalTensor]:
    out = []
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"model state dict entry {name!r} is a {type(value).__name__}, not a tensor"
            )
        if getattr(value, "tensor_model_parallel", None) is not None:
            spec = spec_for_tensor(value, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        elif ctx.tp_size == 1 and ctx.pp_size == 1:
            spec = spec_for_tensor(value, tp_rank=0, tp_size=1)  # one process: it is global
        else:
            spec = rank_local_spec(value)
        out.append(LocalTensor(name, value, spec))
    return out
