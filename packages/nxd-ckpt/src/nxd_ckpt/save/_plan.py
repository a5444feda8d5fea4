"""What one rank writes in a save: its chunks, the tensors it declares, and JSON metadata.

Every rank declares every global tensor it holds a piece of (shape, dtype, sharding), so the
merged index knows each tensor even where another rank wrote the data. Each piece is written
by exactly one of the ranks holding it (:func:`nxd_ckpt.layout._items.is_writer`): replicas over
data parallelism (and over tensor parallelism for replicated tensors) share the work and
write nothing twice; ZeRO-1 shards are written by their owners. At expert parallelism > 1
the EP ranks of a DP group hold different boxes of an expert tensor (its experts), each
written by one rank of the expert-DP group holding it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nxd_ckpt.format import _jsonstate
from nxd_ckpt.format._boxes import Box
from nxd_ckpt.format._stfile import dtype_name
from nxd_ckpt.layout._context import RankContext
from nxd_ckpt.layout._items import DenseSource, TensorItem, is_writer, pieces
from nxd_ckpt.layout._model_tensors import LocalTensor, model_tensors
from nxd_ckpt.layout._sharding import ShardSpec, rank_local_name, rank_local_spec
from nxd_ckpt.save._optim_save import optimizer_save_items
from nxd_state.shards import CheckpointMetadata, json_checkpoint_state

__all__ = ["RankPlan", "WriteChunk", "build_plan"]


@dataclass
class WriteChunk:
    category: str
    name: str
    box: Box
    data: torch.Tensor
    """A view of the local data (any device; made contiguous on CPU when written)."""
    stable: bool = False
    """A view of a tensor changed only by optimizer steps (see ``TensorItem.stable``)."""

    @property
    def key(self) -> str:
        return f"{self.category}/{self.name}@{','.join(map(str, self.box.offsets))}"


@dataclass
class RankPlan:
    ctx: RankContext
    chunks: list[WriteChunk] = field(default_factory=list)
    declared: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    aliases: dict[str, dict[str, str]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(c.data.numel() * c.data.element_size() for c in self.chunks)

    def add(self, item: TensorItem) -> None:
        sharding = dict(item.spec.info)
        if item.spec.rank_local:
            sharding["rank_local"] = True
        entry = {
            "shape": list(item.spec.global_shape),
            "dtype": dtype_name(item.dtype),
            "sharding": sharding,
        }
        self.declared.setdefault(item.category, {})[item.name] = entry
        ctx = self.ctx
        for piece in pieces(item):
            if is_writer(item, piece, ctx):
                data = piece.local
                stable = item.stable
                if data.dtype != item.dtype:
                    data, stable = data.to(item.dtype), False  # a copy: a snapshot already
                chunk = WriteChunk(item.category, item.name, piece.global_box, data, stable)
                self.chunks.append(chunk)


def _whole(category: str, name: str, tensor: torch.Tensor) -> TensorItem:
    """A tensor only this rank has (RNG, scheduler, user content)."""
    spec = ShardSpec(
        tuple(tensor.shape),
        rank_local_spec(tensor).blocks,
        tp_replicated=False,
    )
    return TensorItem(
        category, name, tensor.dtype, spec, DenseSource(tensor.detach()), dp_replicated=False
    )


def _add_model(plan: RankPlan, tensors: list[LocalTensor], aliases: dict[str, str]) -> None:
    for local in tensors:
        stable = isinstance(local.tensor, nn.Parameter)  # buffers may change in forward
        for stored, spec in local.stored():  # its own name, or its declared parts
            name = rank_local_name(stored, plan.ctx) if spec.rank_local else stored
            plan.add(
                TensorItem(
                    "model",
                    name,
                    local.tensor.dtype,
                    spec,
                    DenseSource(local.tensor),
                    stable=stable,
                )
            )
    if aliases:
        plan.aliases["model"] = aliases


def _add_json(plan: RankPlan, category: str, value: Any, what: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    plan.meta[category] = _jsonstate.encode(value, tensors, category, what)
    plan.meta[f"has_{category}"] = True
    for path, tensor in tensors.items():
        plan.add(_whole(category, path, tensor))


def _add_json_state(plan: RankPlan, category: str, owner: Any) -> None:
    """An object's JSON state (:func:`nxd_state.shards.json_checkpoint_state`: the protocol, or
    torch's ``state_dict()``) and its class name, which a load checks."""
    state = json_checkpoint_state(owner).checkpoint_json()
    _add_json(plan, category, state, f"the {category} state")
    plan.meta[f"{category}_class"] = type(owner).__name__


def _add_metadata(plan: RankPlan, metadata: dict[str, Any]) -> None:
    """The model's own index entries (:class:`nxd_state.shards.CheckpointMetadata`: LoRA's
    ``lora``), each under a key nxd-ckpt does not use itself."""
    for key, value in metadata.items():
        if key in plan.meta:
            raise ValueError(
                f"the model's checkpoint_metadata() names {key!r}, an index entry nxd-ckpt "
                f"writes itself"
            )
        plan.meta[key] = value


def _model_config(model: Any) -> dict[str, Any] | None:
    """A Hugging Face model's config as JSON-safe data (for export), else None; its
    ``architectures`` is the model's class when the config does not say (a model built with
    ``from_config``), as ``save_pretrained`` would write it."""
    holders = [model]
    for holder in holders:  # wrappers (LoRAModel, NxDPPModel) forward .config: find its owner
        for attribute in ("module", "original_torch_module"):
            inner = getattr(holder, "__dict__", {}).get(attribute)
            if inner is None and isinstance(holder, nn.Module):
                inner = holder._modules.get(attribute)
            if inner is not None and inner not in holders:
                holders.append(inner)
    owners = [h for h in holders if "config" in getattr(h, "__dict__", {})] or holders
    for holder in owners:
        to_json = getattr(getattr(holder, "config", None), "to_json_string", None)
        if callable(to_json):
            config = json.loads(to_json(use_diff=False))
            if not config.get("architectures"):
                config["architectures"] = [type(holder).__name__]
            return config
    return None


def build_plan(
    ctx: RankContext,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    save_rng: bool = True,
) -> RankPlan:
    """This rank's part of a save (no I/O, no communication)."""
    plan = RankPlan(ctx)
    walked: list[LocalTensor] | None = None
    if model is not None:
        walked, aliases = model_tensors(model, ctx)  # the one walk of the model
        _add_model(plan, walked, aliases)
        config = _model_config(model)
        if config is not None:
            plan.meta["hf_config"] = config
        if isinstance(model, CheckpointMetadata) and ctx.rank == 0:
            _add_metadata(plan, model.checkpoint_metadata())
    if optimizer is not None:
        items, meta = optimizer_save_items(optimizer, model, ctx, walked=walked)
        for item in items:
            plan.add(item)
        plan.meta["optimizer"] = meta
    if save_rng:
        import nxd_state

        for key, state in nxd_state.rng_state_dict().items():
            plan.add(_whole("rng", f"rank{ctx.rank:05d}/{key}", state.detach().cpu()))
    if ctx.rank == 0:
        if scheduler is not None:
            _add_json_state(plan, "scheduler", scheduler)
        if user_content is not None:
            _add_json(plan, "user_content", user_content, "user_content")
    return plan
