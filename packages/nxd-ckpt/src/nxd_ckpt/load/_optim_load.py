"""Optimizer state by parameter name -> the optimizer at hand, at any layout.

For each parameter this rank's optimizer holds, its state tensors ``<name>/<key>`` are read
as the boxes the local layout needs: the parameter's TP blocks for a plain optimizer, or the
ranges of vec(local param) in this rank's ZeRO-1 shard (zero elsewhere: the padding). The
result is handed to the optimizer's own ``load_state_dict`` (ZeRO-1: its local state dict,
whose ``shard`` metadata is taken from the optimizer itself; an EP-aware ZeRO-1's halves
each take their own shards: dense over DP x CP, experts over expert-DP). Hyper-parameters come
from the saved param group holding the same parameter names. Masters are restored when saved, else
rebuilt from the (already loaded) model parameters by the optimizer. A parameter stored in
parts (:mod:`nxd_ckpt.parts`) reads each part's state into its blocks of the local tensor;
state saved under the parameter's own name (before the parts were declared) loads too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.format import _jsonstate
from nxd_ckpt.format._boxes import Box
from nxd_ckpt.format._stfile import dtype_from_name
from nxd_ckpt.layout._context import RankContext
from nxd_ckpt.layout._items import DenseSource, FlatSource, TensorItem, pieces
from nxd_ckpt.layout._optim_common import (
    MASTER_KEY,
    OptimizerView,
    decode_scalar,
    flat_pieces,
    resolve_optimizer,
    zero1_parts,
)
from nxd_ckpt.layout._sharding import shape_mismatch, spec_for_stored_shape
from nxd_ckpt.load._load_model import check_keys
from nxd_ckpt.load._reader import CheckpointReader

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

    def hyper(
        self, names: list[str], position: int, count: int, current: dict[str, Any]
    ) -> dict[str, Any]:
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
    """Match the stored names (collective key and shape checks); the spec of a padded
    parameter whose state was stored padded (older checkpoints) switches to its padded spec."""
    view.match(set(saved.group_of))
    stored_names = view.stored_names(names)
    missing = [n for n in stored_names if n not in saved.group_of]
    mismatched = []
    for name in names:
        targets = view.stored(name)
        for position, (stored, spec) in enumerate(targets):
            for key in saved.keys.get(stored, []):
                shape = tuple(saved.reader.record("optimizer", f"{stored}/{key}").shape)
                fitted = spec_for_stored_shape(spec, shape)
                if fitted is None:
                    mismatched.append(shape_mismatch(f"{stored}/{key}", spec, shape))
                else:
                    targets[position] = (stored, fitted)
    check_keys(
        "optimizer",
        saved.names(),
        set(stored_names),
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
    first = _first(view, names[0])
    for piece, name, shape in zip(located, names, bucket.shapes):
        for stored, spec in view.stored(name):
            _require(saved, stored, key, first)
            source = FlatSource(flat, piece.shard_start, piece.param_start, piece.numel, shape)
            yield TensorItem(
                "optimizer", f"{stored}/{key}", flat.dtype, spec, source, dp_replicated=False
            )


def _first(view: OptimizerView, name: str) -> str:
    """The first stored name of parameter ``name`` (its keys, dtypes and scalars are read)."""
    return view.stored(name)[0][0]


def _require(saved: _Saved, stored: str, key: str, first: str) -> None:
    if f"{stored}/{key}" not in saved.reader.index.category("optimizer"):
        raise ValueError(
            f"checkpoint optimizer state lacks {stored}/{key} but has {first}/{key} (state "
            f"loaded together)"
        )


def _plain_items(
    view: OptimizerView, saved: _Saved, name: str, key: str, value: torch.Tensor
) -> list[TensorItem]:
    """State ``key`` of parameter ``name`` held in ``value`` (shaped like the parameter), one
    item per stored part."""
    out = []
    first = _first(view, name)
    for stored, spec in view.stored(name):
        _require(saved, stored, key, first)
        out.append(
            TensorItem("optimizer", f"{stored}/{key}", value.dtype, spec, DenseSource(value))
        )
    return out


def _inner_names(view: OptimizerView) -> tuple[list[torch.Tensor], list[str]]:
    assert view.inner is not None
    params = [p for g in view.inner.param_groups for p in g["params"]]
    return params, [view.name_of(view.model_param.get(id(p), p)) for p in params]


def _boxes(view: OptimizerView, saved: _Saved) -> Iterator[tuple[str, str, Box]]:
    """The global boxes the fill reads, from the same items over meta tensors (no memory)."""
    if view.kind == "zero1":
        for _, bucket in zero1_parts(view.zeros):
            names = [view.name_of(p) for p in bucket.params]
            first = _first(view, names[0])
            if first not in saved.group_of:
                continue
            for key in saved.tensor_keys(first, masters=True):
                dtype = saved.dtype(first, key)
                flat = torch.empty(bucket.master.numel(), dtype=dtype, device="meta")
                for item in _zero1_items(view, saved, bucket, names, key, flat):
                    for piece in pieces(item):
                        yield "optimizer", item.name, piece.global_box
        return
    params, names = _inner_names(view)
    for param, name in zip(params, names):
        first = _first(view, name)
        for key in saved.tensor_keys(first, masters=True):
            value = torch.empty(param.shape, dtype=saved.dtype(first, key), device="meta")
            for item in _plain_items(view, saved, name, key, value):
                for piece in pieces(item):
                    yield "optimizer", item.name, piece.global_box


def _read_bucket(
    view: OptimizerView, saved: _Saved, bucket: Any
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """One bucket's state (flat shards and scalars) and master shard (None: not saved)."""
    names = [view.name_of(p) for p in bucket.params]
    first = _first(view, names[0])
    keys = saved.tensor_keys(first, masters=True) if first in saved.group_of else []
    entry: dict[str, Any] = {}
    master = None
    for key in keys:
        flat = torch.zeros(bucket.master.numel(), dtype=saved.dtype(first, key))
        for item in _zero1_items(view, saved, bucket, names, key, flat):
            _fill(saved.reader, item)
        if key == MASTER_KEY:
            master = flat
        else:
            entry[key] = _as_state(flat, bucket.master, key)
    entry.update(saved.scalars(first))
    return entry, master


def _set_hypers(view: OptimizerView, hypers: list[dict[str, Any]]) -> None:
    """The caller's param groups get ``hypers``; so does each ZeRO-1 (half), a half's group
    taking those of the caller group its params belong to. (nxd_optim's ``base_optimizer``
    lists a copy of its inner groups: each step copies the half's groups into them.)"""
    groups = view.optimizer.param_groups
    caller = {id(p): gi for gi, group in enumerate(groups) for p in group["params"]}
    for gi, group in enumerate(groups):
        group.update(hypers[gi])
    for part in view.zeros:
        inner = part.inner
        for gi, group in enumerate(part.optimizer.param_groups):
            own = part.optimizer is view.optimizer or not group["params"]
            hyper = hypers[gi] if own else hypers[caller[id(group["params"][0])]]
            group.update(hyper)
            inner.param_groups[gi].update(hyper)


def _prepare_zero1(view: OptimizerView, saved: _Saved) -> Callable[[], None]:
    """Read each bucket's state and master shard into new tensors (nothing in the optimizer
    changes); the returned call puts them into the ZeRO-1 optimizer (each half of an
    EP-aware one: its buckets, its groups' hyper-parameters, its masters)."""
    refresh: list[Any] = []
    loaded: list[tuple[torch.optim.Optimizer, Any, dict[str, Any], torch.Tensor | None]] = []
    for part in view.zeros:
        for inner, bucket in zero1_parts([part]):
            entry, master = _read_bucket(view, saved, bucket)
            loaded.append((inner, bucket, entry, master))
            if master is None and part not in refresh:
                refresh.append(part)
    groups = view.optimizer.param_groups
    hypers = []
    for gi, group in enumerate(groups):
        names = view.stored_names([view.name_of(p) for p in group["params"]])
        hypers.append(saved.hyper(names, gi, len(groups), group))

    def apply() -> None:
        for inner, bucket, entry, master in loaded:
            if master is not None:
                with torch.no_grad():
                    bucket.master.copy_(master)
            if entry:
                inner.state[bucket.master] = entry
            else:
                inner.state.pop(bucket.master, None)
        _set_hypers(view, hypers)
        for part in refresh:  # masters not saved: rebuild them from the loaded model params
            part.optimizer.refresh_masters_from_params()

    return apply


def _prepare_plain(view: OptimizerView, saved: _Saved) -> Callable[[], None]:
    """Read the state into a new state dict (nothing in the optimizer changes); the returned
    call hands it to the optimizer's ``load_state_dict``."""
    inner = view.inner
    assert inner is not None
    inner_params, names = _inner_names(view)
    state: dict[int, dict[str, Any]] = {}
    masters: list[torch.Tensor] = []
    for index, (param, name) in enumerate(zip(inner_params, names)):
        entry: dict[str, Any] = {}
        # Padding is stored nowhere (zeros); parts tile the tensor exactly.
        padded = any(spec.padded is not None for _, spec in view.stored(name))
        first = _first(view, name)
        for key in saved.tensor_keys(first, masters=True):
            allocate = torch.zeros if padded else torch.empty
            value = allocate(param.shape, dtype=saved.dtype(first, key))
            for item in _plain_items(view, saved, name, key, value):
                _fill(saved.reader, item)
            if key == MASTER_KEY:
                if id(param) in view.model_param:
                    masters.append(value)
            else:
                entry[key] = value
        entry.update(saved.scalars(first))
        if entry:
            state[index] = entry
    groups, position = [], 0
    for gi, group in enumerate(inner.param_groups):
        count = len(group["params"])
        group_names = view.stored_names(names[position : position + count])
        hyper = saved.hyper(group_names, gi, len(inner.param_groups), group)
        groups.append({**hyper, "params": list(range(position, position + count))})
        position += count
    state_dict: dict[str, Any] = {"state": state, "param_groups": groups}
    expected_masters = sum(1 for p in inner_params if id(p) in view.model_param)
    if expected_masters and len(masters) == expected_masters:
        state_dict["master_weights"] = masters
    return lambda: view.optimizer.load_state_dict(state_dict)


@dataclass
class OptimizerReads:
    """An optimizer matched with the tag's state (keys and class checked): :meth:`boxes`
    lists the global boxes the load reads; :meth:`prepare` reads (and checks) them into new
    tensors, changing nothing, and returns the call that puts them into the optimizer;
    :meth:`fill` does both."""

    view: OptimizerView
    saved: _Saved

    def boxes(self) -> Iterator[tuple[str, str, Box]]:
        return _boxes(self.view, self.saved)

    def prepare(self) -> Callable[[], None]:
        if self.view.kind == "zero1":
            return _prepare_zero1(self.view, self.saved)
        return _prepare_plain(self.view, self.saved)

    def fill(self) -> None:
        self.prepare()()


def optimizer_reads(
    optimizer: Any, model: Any, reader: CheckpointReader, ctx: RankContext, strict: bool
) -> OptimizerReads:
    """Match ``optimizer``'s parameters with the tag's state (the key check is collective)."""
    view = resolve_optimizer(optimizer, model, ctx)
    saved = _Saved(reader)
    saved_class = saved.meta.get("class")
    if saved_class is not None and saved_class != view.class_name:
        raise ValueError(
            f"{reader.tag_dir}: its optimizer state was saved from {saved_class}, this "
            f"optimizer is {view.class_name}: state of another optimizer type is not loaded "
            f"(nothing was loaded)"
        )
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
