"""★ Reading NxD's own checkpoints (``model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt`` …).

NxD pickles one state dict per (TP, PP) rank with ``torch.save`` and records no sharding:
partition dims come from the *target* model's parameter attributes (or, for conversion
without a model, from name rules). Files are read with ``torch.load(weights_only=True)``
only; xser files (tensors as ``TensorReference(tid)`` plus ``<file>.tensors/tensor_<tid>.pt``)
load with a stand-in class allowlisted under torch-xla's dotted name, so torch-xla is never
imported. ``user_content.pt`` and ``scheduler.pt`` may hold arbitrary objects: they are read
only with ``allow_pickle=True``.

The files become an in-memory index (for each saved rank t of T, the blocks of its tensor
under the target's sharding attributes, with NxD's per-rank padding and GQA head order mapped
as :mod:`nxd_ckpt.sources._nxd_layout` says), so loading reshards to any TP degree with the
same code as this package's own format. Optimizer state (plain, or torch-xla ZeRO-1's
``base_state`` sharded along dim 0 per parameter, unpadded with ``shape_info``) maps
positions to parameter names through the target optimizer, at the saved pipeline degree.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nxd_ckpt.format import (
    CheckpointIndex,
    ChunkRecord,
    FormatError,
    TensorRecord,
    _jsonstate,
)
from nxd_ckpt.format._boxes import Box
from nxd_ckpt.format._nxd_files import is_nxd_checkpoint, refuse_link, scan
from nxd_ckpt.format._stfile import dtype_name
from nxd_ckpt.layout._context import RankContext, current_context
from nxd_ckpt.layout._optim_common import encode_scalar, resolve_optimizer
from nxd_ckpt.layout._sharding import ShardSpec
from nxd_ckpt.load._load_model import model_reads
from nxd_ckpt.load._optim_load import optimizer_reads
from nxd_ckpt.load._reader import CheckpointReader
from nxd_ckpt.load._restore import apply_scheduler
from nxd_ckpt.sources._nxd_layout import SavedGQA, saved_gqa_layouts, saved_spec
from nxd_state.shards import CheckpointState

__all__ = ["is_nxd_checkpoint", "load_nxd_checkpoint", "torch_load_safe"]

logger = logging.getLogger(__name__)

_XSER_NAME = "torch_xla.utils.serialization.TensorReference"


class _TensorReference:
    """Stands in for torch-xla's ``TensorReference``: only its tensor id is used."""

    tid: int


def _resolve_xser(value: Any, folder: Path) -> Any:
    if isinstance(value, _TensorReference):
        tid = getattr(value, "tid", None)
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise FormatError(f"{folder}: an xser tensor reference has tensor id {tid!r}")
        path = folder / f"tensor_{tid}.pt"
        refuse_link(path)
        return torch_load_safe(path)
    if isinstance(value, dict):
        return {k: _resolve_xser(v, folder) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve_xser(v, folder) for v in value)
    return value


def torch_load_safe(path: str | os.PathLike[str]) -> Any:
    """``torch.load(weights_only=True)``, resolving xser tensor references (no torch-xla)."""
    path = Path(path)
    with torch.serialization.safe_globals([(_TensorReference, _XSER_NAME)]):
        try:
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # not a zip archive (legacy format): no mmap
            value = torch.load(path, map_location="cpu", weights_only=True)
    tensors = path.with_name(path.name + ".tensors")
    if tensors.is_symlink():
        refuse_link(tensors)
    return _resolve_xser(value, tensors) if tensors.is_dir() else value


class _TorchSource:
    """Tensors of one (or several merged) torch-saved files, read lazily, sliced per box."""

    def __init__(self, loader: Callable[[], dict[str, torch.Tensor]]) -> None:
        self._loader = loader
        self._tensors: dict[str, torch.Tensor] | None = None

    @classmethod
    def holding(cls, tensors: dict[str, torch.Tensor]) -> _TorchSource:
        """A source over tensors already in memory."""
        return cls(lambda: tensors)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self._loader()
        return self._tensors

    def read(self, chunk: ChunkRecord, box: Box) -> torch.Tensor:
        tensor = self.tensors[chunk.key]
        origin = tuple(chunk.stored_offsets or [0] * tensor.dim())
        return tensor[box.shifted(origin).slices()]


def _chunks(spec: ShardSpec, relative: str, key: str, t: int, p: int) -> list[ChunkRecord]:
    if spec.tp_replicated and t != 0:
        return []
    return [
        ChunkRecord(
            relative,
            key,
            list(b.global_offsets),
            list(b.local.shape),
            [],
            1,
            t,
            p,
            0,
            list(b.local.offsets),
        )
        for b in spec.blocks
        if b.primary
    ]


def _modules(model: Any, walked: list[Any]) -> dict[str, torch.nn.Module]:
    """Module name -> module under the original names: a model's own modules; for a model
    describing its own checkpoint state (a pipeline model's stages), the modules holding the
    tensors it named (a LoRA model names none: its own modules)."""
    owners = {t.name.rpartition(".")[0]: t.owner for t in walked if t.owner is not None}
    if owners and isinstance(model, CheckpointState):
        return owners
    return dict(model.named_modules()) if isinstance(model, torch.nn.Module) else {}


def _model_index(
    tag_dir: Path, model: Any, ctx: RankContext
) -> tuple[
    CheckpointIndex,
    dict[str, _TorchSource],
    int,
    dict[str, torch.nn.Module],
    dict[str, SavedGQA],
]:
    from nxd_ckpt.layout._model_tensors import model_tensors

    files = {(tp, pp): path for (dp, tp, pp), path in scan(tag_dir / "model").items() if dp == 0}
    if not files:
        raise FileNotFoundError(f"{tag_dir}/model holds no dp_rank_00_tp_rank_XX_pp_rank_YY.pt")
    size = max(tp for tp, _ in files) + 1
    sources = {
        f"model/{p.name}": _TorchSource(functools.partial(torch_load_safe, p))
        for p in files.values()
    }
    targets, _ = model_tensors(model, ctx)
    by_name = {local.name: local for local in targets}
    modules = _modules(model, targets)
    first_rank: dict[str, Any] = {}  # TP rank 0 of every stage: the saved GQA layouts
    for (t, _), path in files.items():
        if t == 0:
            first_rank.update(sources[f"model/{path.name}"].tensors)
    layouts = saved_gqa_layouts(modules, first_rank, size)
    records: dict[str, TensorRecord] = {}
    for (t, p), path in sorted(files.items()):
        relative = f"model/{path.name}"
        for name, tensor in sources[relative].tensors.items():
            shape = tuple(tensor.shape)
            local = by_name.get(name)
            if local is None:  # not on this rank: known by name (for the collective key check)
                records.setdefault(name, TensorRecord(list(shape), dtype_name(tensor.dtype)))
                continue
            prefix, _, leaf = name.rpartition(".")
            module = modules.get(prefix)
            spec = saved_spec(local.tensor, module, prefix, leaf, shape, t, size, layouts)
            record = records.get(name)
            if record is None or not record.chunks:
                record = TensorRecord(list(spec.global_shape), dtype_name(tensor.dtype))
                records[name] = record
            record.chunks += _chunks(spec, relative, name, t, p)
    index = CheckpointIndex(
        tag=tag_dir.name, save_id="nxd", parallel={"tensor_parallel_size": size}
    )
    index.tensors["model"] = records
    return index, sources, size, modules, layouts


def _optimizer_index(
    tag_dir: Path,
    optimizer: Any,
    model: Any,
    ctx: RankContext,
    size: int,
    modules: dict[str, torch.nn.Module],
    layouts: dict[str, SavedGQA],
) -> tuple[dict[str, TensorRecord], dict[str, Any], dict[str, _TorchSource]]:
    """Optimizer state of an NxD tag as global tensors named ``<param>/<key>``."""
    files = _optimizer_files(tag_dir, ctx)
    view = resolve_optimizer(optimizer, model, ctx)
    params = [view.model_param.get(id(p), p) for g in view.param_groups for p in g["params"]]
    names = [view.name_of(p) for p in params]
    targets = dict(zip(names, params))
    zero1 = any(dp > 0 for dp, _, _ in files)
    sources: dict[str, _TorchSource] = {}
    records: dict[str, TensorRecord] = {}
    meta: dict[str, Any] = {"param_groups": [], "scalars": {}, "by_position": False}
    for t in range(size):
        ranks = sorted(dp for dp, tp, pp in files if tp == t and pp == ctx.pp_rank)
        states = [torch_load_safe(files[(dp, t, ctx.pp_rank)]) for dp in ranks]
        if not states:
            continue
        flat = _optimizer_tensors(states, zero1)
        relative = f"optim/tp{t:02d}"
        sources[relative] = _TorchSource.holding(flat)
        for key, tensor in flat.items():
            position, _, state_key = key.partition("/")
            if int(position) >= len(names):
                raise ValueError(
                    f"{tag_dir}: optimizer state for parameter {position}, but the "
                    f"optimizer holds {len(names)}"
                )
            name = names[int(position)]
            if tensor.dim() == 0:  # step
                meta["scalars"].setdefault(name, {})[state_key] = encode_scalar(tensor, key)
                continue
            prefix, _, leaf = name.rpartition(".")
            spec = saved_spec(
                targets[name],
                modules.get(prefix),
                prefix,
                leaf,
                tuple(tensor.shape),
                t,
                size,
                layouts,
            )
            full = f"{name}/{state_key}"
            record = records.setdefault(
                full, TensorRecord(list(spec.global_shape), dtype_name(tensor.dtype))
            )
            record.chunks += _chunks(spec, relative, key, t, ctx.pp_rank)
        if t == 0:
            meta["param_groups"] = _param_groups(states[0], names)
    return records, meta, sources


def _optimizer_files(tag_dir: Path, ctx: RankContext) -> dict[tuple[int, int, int], Path]:
    """The tag's optimizer files by (DP, TP, PP) rank; refused unless saved at this run's
    pipeline degree (NxD's optimizer state names parameters by position in the stage)."""
    files = scan(tag_dir / "optim")
    if not files:
        raise FileNotFoundError(f"{tag_dir}/optim holds no NxD optimizer files")
    pp_saved = max(pp for _, _, pp in files) + 1
    if pp_saved != ctx.pp_size:
        raise ValueError(
            f"{tag_dir}: NxD optimizer state indexes parameters by position, so it loads at the "
            f"saved pipeline degree {pp_saved} only (this run has {ctx.pp_size})"
        )
    return files


def _param_groups(state: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """The index's param groups of an NxD optimizer state: each group's hyper-parameters as
    JSON and its parameters' names (positions ``first … first + count`` of ``names``)."""
    groups, first = [], 0
    for group in state["param_groups"]:
        count = len(group["params"])
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append(
            {
                "hyper": _jsonstate.encode(hyper, {}, "param_groups", "hyper-parameters"),
                "params": names[first : first + count],
            }
        )
        first += count
    return groups


def _optimizer_tensors(states: list[dict[str, Any]], zero1: bool) -> dict[str, torch.Tensor]:
    """``"<position>/<key>"`` -> the TP-local tensor (ZeRO-1 shards joined and unpadded)."""
    out: dict[str, torch.Tensor] = {}
    if not zero1:
        for position, entry in states[0]["state"].items():
            for key, value in entry.items():
                out[f"{position}/{key}"] = torch.as_tensor(value)
        return out
    shapes = states[0]["shape_info"]
    for position, entry in states[0]["base_state"].items():
        shape = tuple(shapes[position])
        for key, value in entry.items():
            if key == "step" or torch.as_tensor(value).dim() == 0:
                out[f"{position}/{key}"] = torch.as_tensor(value)
                continue
            pieces = [state["base_state"][position][key] for state in states]
            joined = torch.cat([piece.reshape(piece.shape[0], *shape[1:]) for piece in pieces])
            out[f"{position}/{key}"] = joined[: shape[0]] if shape else joined.reshape(())
    return out


def _pickled(tag_dir: Path, name: str, allow_pickle: bool) -> Any:
    path = tag_dir / name
    refuse_link(path)
    if not path.exists():
        return None
    if not allow_pickle:
        raise PermissionError(
            f"{path} is a pickle that may run code when loaded; pass allow_pickle=True only for "
            f"a checkpoint you trust"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def load_nxd_checkpoint(
    tag_dir: str | os.PathLike[str],
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    strict: bool = True,
    allow_pickle: bool = False,
) -> Any:
    """Load an NxD-layout tag into ``model`` / ``optimizer`` (any TP degree; the saved PP
    degree for the optimizer); returns the user content (only with ``allow_pickle``)."""
    tag_dir = Path(tag_dir)
    ctx = current_context()
    ctx.refuse_expert_parallel(
        "loading NxD's checkpoint layout",
        "its per-TP-rank files do not say which experts they hold; load it at EP=1 and "
        "save it with save_checkpoint, which loads at any EP degree",
    )
    if model is None:
        raise ValueError("loading an NxD checkpoint needs model= (partition dims come from it)")
    index, sources = _nxd_index(tag_dir, model, optimizer, ctx)
    reader = CheckpointReader(tag_dir, index=index, sources=sources)
    # Everything is read and matched before anything changes: every file unpickled (no CRCs
    # here: a damaged file fails its torch.load), names and shapes checked, the optimizer
    # state built, the scheduler state read; then the scheduler (undone if what follows
    # fails), the model and the optimizer are set.
    for source in sources.values():
        _ = source.tensors
    model_part = model_reads(model, reader, ctx, strict)
    prepared = None
    if optimizer is not None:
        prepared = optimizer_reads(optimizer, model, reader, ctx, strict).prepare()
    state = None
    if scheduler is not None:
        state = _pickled(tag_dir, "scheduler.pt", allow_pickle)
        if state is None:
            raise FileNotFoundError(f"{tag_dir}/scheduler.pt does not exist")
    content = _pickled(tag_dir, "user_content.pt", allow_pickle) if allow_pickle else None
    restore = apply_scheduler(scheduler, state, str(tag_dir))
    try:
        model_part.fill(reader)
        if prepared is not None:
            prepared()
    except BaseException:
        restore()
        raise
    if not allow_pickle and (tag_dir / "user_content.pt").exists():
        _warn_user_content_unread(tag_dir)
    return content


def _nxd_index(
    tag_dir: Path, model: Any, optimizer: Any, ctx: RankContext
) -> tuple[CheckpointIndex, dict[str, _TorchSource]]:
    """An index, built in memory, of an NxD tag's model (and optimizer) state as global
    tensors, and the unpickled files its chunks name."""
    index, sources, size, modules, layouts = _model_index(tag_dir, model, ctx)
    if optimizer is not None:
        records, meta, optimizer_sources = _optimizer_index(
            tag_dir, optimizer, model, ctx, size, modules, layouts
        )
        index.tensors["optimizer"] = records
        index.optimizer = meta
        sources.update(optimizer_sources)
    return index, sources


def _warn_user_content_unread(tag_dir: Path) -> None:
    """A warning, not an error: the weights loaded fine, and an error would push a job that
    only wants them to pass allow_pickle=True (running code from the file)."""
    message = (
        f"{tag_dir / 'user_content.pt'} was NOT read: it is a pickle (it may run code "
        f"when loaded), so load_checkpoint returns None instead of the user content; pass "
        f"allow_pickle=True only for a checkpoint you trust to read it"
    )
    logger.warning(message)
    warnings.warn(message, UserWarning, stacklevel=4)  # load_checkpoint's caller
