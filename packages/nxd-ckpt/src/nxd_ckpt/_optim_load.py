"""Optimizer state by parameter name -> the optimizer at hand, at any layout.

For each parameter this rank's optimizer holds, its state tensors ``<name>/<key>`` are read
as the boxes the local layout needs: the parameter's TP blocks for a plain optimizer, or the
ranges of vec(local param) in this rank's ZeRO-1 shard (zero elsewhere: the padding). The
result is handed to the optimizer's own ``load_state_dict`` (ZeRO-1: its local state dict,
whose ``shard`` metadata is taken from the optimizer itself). Hyper-parameters come from the
saved param group holding the same parameter names. Masters are restored when saved, else
rebuilt from the (already loaded) model parameters by the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import _jsonstate
from nxd_ckpt._boxes import Box
from nxd_ckpt._context import RankContext
from nxd_ckpt._items import DenseSource, FlatSource, TensorItem, pieces
from nxd_ckpt._load_model import check_keys
from nxd_ckpt._optim_common import (
    MASTER_KEY,
    OptimizerView,
    decode_scalar,
    flat_pieces,
    resolve_optimizer,
    zero1_buckets,
    zero1_inner,
)
from nxd_ckpt._reader import CheckpointReader
from nxd_ckpt._sharding import spec_for_stored_shape
from nxd_ckpt._stfile import dtype_from_name

__all__ = ["OptimizerReads", "load_optimizer", "optimizer_reads"]


class _Saved:
    """The optimizer part of an index, by parameter name."""

    def __init__(self, reader: CheckpointReader) -> None:
        meta = reader.index.optimizer
        if meta is None:
            raise ValueError(f"{reader.tag_dir} holds no optimizer state")
        self.reader = reader
        self.meta = meta
        self.keys: dict[str, list[str]] = {}
        for full in reader.index.category("optimizer"):
            name, _, key = full.rpartition("/")
            self.keys.setdefault(name, []).append(key)
        self.group_of = {
            name: index
            for index, group in enumerate(meta["param_groups"])
            for name in group["params"]
        }

    def names(self) -> list[str]:
        return sorted(self.group_of)

    def tensor_keys(self, name: str, *, masters: bool) -> list[str]:
        keys = self.keys.get(name, [])
        return [k for k in keys if k != MASTER_KEY] + (
            [MASTER_KEY] if masters and MASTER_KEY in keys else []
        )

    def scalars(self, name: str) -> dict[str, Any]:
        return {k: decode_scalar(v) for k, v in self.meta["scalars"].get(name, {}).items()}

    def hyper(self, names: list[str], position: int, count: int, current: dict[str, Any]):
        for name in names:
            if name in self.group_of:
                return _jsonstate.decode(
                    self.meta["param_groups"][self.group_of[name]]["hyper"], {}
                )
        groups = self.meta["param_groups"]
        if len(groups) == count:
            return _jsonstate.decode(groups[position]["hyper"], {})
        return {k: v for k, v in current.items() if k != "params"}

    def dtype(self, name: str, key: str) -> torch.dtype:
        return dtype_from_name(self.reader.record("optimizer", f"{name}/{key}").dtype)


def _fill(reader: CheckpointReader, item: TensorItem) -> None:
    for piece in pieces(item):
        reader.read_box("optimizer", item.name, piece.global_box, out=piece.local)


def _check(view: OptimizerView, saved: _Saved, names: list[str], strict: bool) -> None:
    """Key and shape checks (collective); ``view.specs`` of a padded parameter whose state
    was stored padded (older checkpoints) switch to its padded spec."""
    missing = [n for n in names if n not in saved.group_of]
    mismatched = []
    for name in names:
        for key in saved.keys.get(name, []):
            shape = tuple(saved.reader.record("optimizer", f"{name}/{key}").shape)
            spec = spec_for_stored_shape(view.specs[name], shape)
            if spec is None:
                mismatched.append(
                    f"{name}/{key}: checkpoint {shape}, model "
                    f"{tuple(view.specs[name].global_shape)}"
                )
            else:
                view.specs[name] = spec
    check_keys(
        "optimizer",
        saved.names(),
        set(names),
        missing,
        mismatched,
        strict,
        str(saved.reader.tag_dir),
    )


def _as_state(value: torch.Tensor, like: torch.Tensor, key: str) -> torch.Tensor:
    """A loaded state tensor in the dtype/device the optimizer keeps it (as torch does)."""
    if key == "step" or not value.is_floating_point():
        return value
    return value.to(dtype=like.dtype, device=like.device)


def _zero1_items(
    view: OptimizerView,
    saved: _Saved,
    bucket: Any,
    names: list[str],
    key: str,
    flat: torch.Tensor,
) -> Iterator[TensorItem]:
    """State ``key`` of each parameter of a ZeRO-1 bucket, held in this rank's ``flat``."""
    located = flat_pieces(bucket.shapes, bucket.num_shards, bucket.rank)
    for piece, name, shape in zip(located, names, bucket.shapes):
        if f"{name}/{key}" not in saved.reader.index.category("optimizer"):
            raise ValueError(
                f"checkpoint optimizer state lacks {name}/{key} but has "
                f"{names[0]}/{key} (same ZeRO-1 bucket)"
            )
        source = FlatSource(flat, piece.shard_start, piece.param_start, piece.numel, shape)
        yield TensorItem(
            "optimizer", f"{name}/{key}", flat.dtype, view.specs[name], source, dp_replicated=False
        )


def _plain_item(view: OptimizerView, name: str, key: str, value: torch.Tensor) -> TensorItem:
    return TensorItem(
        "optimizer", f"{name}/{key}", value.dtype, view.specs[name], DenseSource(value)
    )


def _inner_names(view: OptimizerView) -> tuple[list[torch.Tensor], list[str]]:
    assert view.inner is not None
    params = [p for g in view.inner.param_groups for p in g["params"]]
    return params, [view.name_of(view.model_param.get(id(p), p)) for p in params]


def _boxes(view: OptimizerView, saved: _Saved) -> Iterator[tuple[str, str, Box]]:
    """The global boxes the fill reads, from the same items over meta tensors (no memory)."""
    if view.kind == "zero1":
        for bucket in zero1_buckets(view.optimizer):
            names = [view.name_of(p) for p in bucket.params]
            if names[0] not in saved.group_of:
                continue
            for key in saved.tensor_keys(names[0], masters=True):
                dtype = saved.dtype(names[0], key)
                flat = torch.empty(bucket.master.numel(), dtype=dtype, device="meta")
                for item in _zero1_items(view, saved, bucket, names, key, flat):
                    for piece in pieces(item):
                        yield "optimizer", item.name, piece.global_box
        return
    params, names = _inner_names(view)
    for param, name in zip(params, names):
        for key in saved.tensor_keys(name, masters=True):
            value = torch.empty(param.shape, dtype=saved.dtype(name, key), device="meta")
            for piece in pieces(_plain_item(view, name, key, value)):
                yield "optimizer", f"{name}/{key}", piece.global_box


def _load_zero1(view: OptimizerView, saved: _Saved) -> None:
    """Write each bucket's state and master shard straight into the ZeRO-1 optimizer."""
    zero = view.optimizer
    inner = zero1_inner(zero)
    refresh = False
    for bucket in zero1_buckets(zero):
        names = [view.name_of(p) for p in bucket.params]
        keys = saved.tensor_keys(names[0], masters=True) if names[0] in saved.group_of else []
        entry: dict[str, Any] = {}
        has_master = False
        for key in keys:
            flat = torch.zeros(bucket.master.numel(), dtype=saved.dtype(names[0], key))
            for item in _zero1_items(view, saved, bucket, names, key, flat):
                _fill(saved.reader, item)
            if key == MASTER_KEY:
                with torch.no_grad():
                    bucket.master.copy_(flat)
                has_master = True
            else:
                entry[key] = _as_state(flat, bucket.master, key)
        for key, value in saved.scalars(names[0]).items():
            entry[key] = value
        if entry:
            inner.state[bucket.master] = entry
        else:
            inner.state.pop(bucket.master, None)
        refresh = refresh or not has_master
    groups = zero.param_groups
    for gi, group in enumerate(groups):
        names = [view.name_of(p) for p in group["params"]]
        hyper = saved.hyper(names, gi, len(groups), group)
        group.update(hyper)
        inner.param_groups[gi].update(hyper)
    if refresh:  # masters not saved: rebuild them from the (already loaded) model params
        zero.refresh_masters_from_params()


def _load_plain(view: OptimizerView, saved: _Saved) -> None:
    inner = view.inner
    assert inner is not None
    inner_params, names = _inner_names(view)
    state: dict[int, dict[str, Any]] = {}
    masters: list[torch.Tensor] = []
    for index, (param, name) in enumerate(zip(inner_params, names)):
        entry: dict[str, Any] = {}
        padded = view.specs[name].padded is not None  # its padding is stored nowhere: zeros
        for key in saved.tensor_keys(name, masters=True):
            allocate = torch.zeros if padded else torch.empty
            value = allocate(param.shape, dtype=saved.dtype(name, key))
            _fill(saved.reader, _plain_item(view, name, key, value))
            if key == MASTER_KEY:
                if id(param) in view.model_param:
                    masters.append(value)
            else:
                entry[key] = value
        entry.update(saved.scalars(name))
        if entry:
            state[index] = entry
    groups, position = [], 0
    for gi, group in enumerate(inner.param_groups):
        count = len(group["params"])
        hyper = saved.hyper(names[position : position + count], gi, len(inner.param_groups), group)
        groups.append({**hyper, "params": list(range(position, position + count))})
        position += count
    state_dict: dict[str, Any] = {"state": state, "param_groups": groups}
    expected_masters = sum(1 for p in inner_params if id(p) in view.model_param)
    if expected_masters and len(masters) == expected_masters:
        state_dict["master_weights"] = masters
    view.optimizer.load_state_dict(state_dict)


@dataclass
class OptimizerReads:
    """An optimizer matched with the tag's state (keys checked): :meth:`boxes` lists the
    global boxes the load reads, :meth:`fill` loads the state into the optimizer."""

    view: OptimizerView
    saved: _Saved

    def boxes(self) -> Iterator[tuple[str, str, Box]]:
        return _boxes(self.view, self.saved)

    def fill(self) -> None:
        if self.view.kind == "zero1":
            _load_zero1(self.view, self.saved)
        else:
            _load_plain(self.view, self.saved)


def optimizer_reads(
    optimizer: Any, model: Any, reader: CheckpointReader, ctx: RankContext, strict: bool
) -> OptimizerReads:
    """Match ``optimizer``'s parameters with the tag's state (the key check is collective)."""
    view = resolve_optimizer(optimizer, model, ctx)
    saved = _Saved(reader)
    if saved.meta.get("by_position") != (model is None):
        raise ValueError(
            f"{reader.tag_dir}: optimizer state was saved "
            f"{'by position (no model)' if saved.meta.get('by_position') else 'by parameter name'}"
            f"; pass {'no ' if saved.meta.get('by_position') else ''}model= to load it"
        )
    if view.kind == "zero1":
        names = [view.name_of(p) for g in view.optimizer.param_groups for p in g["params"]]
    else:
        names = _inner_names(view)[1]
    _check(view, saved, names, strict)
    return OptimizerReads(view, saved)


def load_optimizer(
    optimizer: Any,
    model: Any,
    reader: CheckpointReader,
    ctx: RankContext,
    strict: bool,
    slot: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Load the optimizer state of ``reader``'s tag into ``optimizer`` (after the model);
    the key check is collective, the reads run under ``slot``."""
    reads = optimizer_reads(optimizer, model, reader, ctx, strict)
    with slot():
        reads.fill()
