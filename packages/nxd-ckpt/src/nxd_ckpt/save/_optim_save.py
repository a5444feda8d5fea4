"""Optimizer state -> tensor items by parameter name, and JSON metadata.

For parameter ``w`` and state key ``k`` the global tensor ``w/k`` has ``w``'s global shape:
a plain optimizer's state tensor is sharded like ``w`` (same spec); a ZeRO-1 rank holds a
contiguous range of vec(local ``w``) of it, which :class:`FlatSource` maps to boxes (for an
expert ``w`` under ``NeuronEPZero1Optimizer``: a range of this EP rank's experts, cut over the
expert-DP group; the ranges of the group's ranks tile them, so each rank writes its own). fp32
master weights are ``w/master`` when the optimizer keeps them in checkpoints. Scalars
(``step``) and each param group's hyper-parameters and parameter names go to JSON. A
parameter stored in parts (:mod:`nxd_ckpt.parts`) has its state stored per part, under the
parts' names, each with the part's spec (blocks of the same local tensor or shard range).
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_ckpt.format import _jsonstate
from nxd_ckpt.layout._context import RankContext
from nxd_ckpt.layout._items import DenseSource, FlatSource, TensorItem
from nxd_ckpt.layout._model_tensors import LocalTensor
from nxd_ckpt.layout._optim_common import (
    MASTER_KEY,
    OptimizerView,
    encode_scalar,
    flat_pieces,
    resolve_optimizer,
    zero1_parts,
)

__all__ = ["optimizer_save_items"]


def _hyper(group: dict[str, Any], where: str) -> Any:
    tensors: dict[str, torch.Tensor] = {}
    hyper = {k: v for k, v in group.items() if k != "params"}
    encoded = _jsonstate.encode(hyper, tensors, where, "optimizer hyper-parameters")
    if tensors:
        raise TypeError(
            f"{where}: tensor-valued hyper-parameters {sorted(tensors)} cannot be saved; use floats"
        )
    return encoded


def _zero1_items(view: OptimizerView) -> tuple[list[TensorItem], dict]:
    zero = view.optimizer
    items: list[TensorItem] = []
    meta: dict[str, Any] = {"param_groups": [], "scalars": {}}
    for inner, bucket in zero1_parts(view.zeros):  # both halves of an EP-aware ZeRO-1
        names = [view.name_of(p) for p in bucket.params]
        located = flat_pieces(bucket.shapes, bucket.num_shards, bucket.rank)
        values = dict(inner.state.get(bucket.master, {}))
        if view.masters_in_ckpt:
            values[MASTER_KEY] = bucket.master
        for key, value in values.items():
            sharded = isinstance(value, torch.Tensor) and value.shape == bucket.master.shape
            for piece, name, shape in zip(located, names, bucket.shapes):
                for stored, spec in view.stored(name):
                    if not sharded:
                        where = f"{stored}/{key}"
                        meta["scalars"].setdefault(stored, {})[key] = encode_scalar(value, where)
                        continue
                    source = FlatSource(
                        value, piece.shard_start, piece.param_start, piece.numel, shape
                    )
                    items.append(
                        TensorItem(
                            "optimizer",
                            f"{stored}/{key}",
                            value.dtype,
                            spec,
                            source,
                            dp_replicated=False,
                            stable=True,
                        )
                    )
    for gi, group in enumerate(zero.param_groups):
        names = view.stored_names([view.name_of(p) for p in group["params"]])
        meta["param_groups"].append({"hyper": _hyper(group, f"param_groups.{gi}"), "params": names})
    return items, meta


def _plain_items(view: OptimizerView) -> tuple[list[TensorItem], dict]:
    inner = view.inner
    assert inner is not None
    state_dict = inner.state_dict()
    inner_params = [p for group in inner.param_groups for p in group["params"]]
    items: list[TensorItem] = []
    meta: dict[str, Any] = {"param_groups": [], "scalars": {}}
    for index, param in enumerate(inner_params):
        model_param = view.model_param.get(id(param), param)
        for name, spec in view.stored(view.name_of(model_param)):
            for key, value in state_dict["state"].get(index, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and value.shape == param.shape
                ):
                    source = DenseSource(value)
                    item = TensorItem(
                        "optimizer", f"{name}/{key}", value.dtype, spec, source, stable=True
                    )
                    items.append(item)
                else:
                    where = f"{name}/{key}"
                    meta["scalars"].setdefault(name, {})[key] = encode_scalar(value, where)
            if view.masters_in_ckpt and id(param) in view.model_param:
                items.append(
                    TensorItem(
                        "optimizer",
                        f"{name}/{MASTER_KEY}",
                        param.dtype,
                        spec,
                        DenseSource(param),
                        stable=True,
                    )
                )
    position = 0
    for gi, group in enumerate(state_dict["param_groups"]):
        count = len(group["params"])
        names = view.stored_names(
            [
                view.name_of(view.model_param.get(id(p), p))
                for p in inner_params[position : position + count]
            ]
        )
        position += count
        meta["param_groups"].append({"hyper": _hyper(group, f"param_groups.{gi}"), "params": names})
    return items, meta


def optimizer_save_items(
    optimizer: Any, model: Any, ctx: RankContext, *, walked: list[LocalTensor] | None = None
) -> tuple[list[TensorItem], dict[str, Any]]:
    """This rank's optimizer tensors and the JSON metadata of its optimizer; ``walked``: the
    model's tensors when the caller has walked it already (else the model is walked here)."""
    view = resolve_optimizer(optimizer, model, ctx, walked=walked)
    items, meta = _zero1_items(view) if view.kind == "zero1" else _plain_items(view)
    meta.update(
        {
            "class": view.class_name,
            "zero1": view.kind == "zero1",
            "master_weights": any(item.name.endswith(f"/{MASTER_KEY}") for item in items),
            "by_position": model is None,
        }
    )
    return items, meta
