"""Writing a rank's file and manifest, staging for async saves, and merging the manifests.

Each rank writes ``data-<id>/<coords>.safetensors`` (its chunks) and then
``data-<id>/manifest_rank_<r>.json`` (what it wrote and declared); a manifest exists only
after its data file is durable. Rank 0 merges the manifests into the index once all exist,
checking that every tensor's chunks cover it exactly once.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nxd_ckpt.format import (
    FORMAT_VERSION,
    CheckpointIndex,
    ChunkRecord,
    FileRecord,
    FormatError,
    TensorRecord,
)
from nxd_ckpt.format._stfile import (
    FileDigest,
    FilePlan,
    plan_file,
    write_planned,
    write_text_atomic,
)
from nxd_ckpt.save._memcopy import copy_into
from nxd_ckpt.save._plan import RankPlan, WriteChunk

__all__ = [
    "DeferredCopy",
    "StagingBuffer",
    "copy_deferred",
    "file_plan_for",
    "manifest_path",
    "merge_manifests",
    "write_rank",
]

logger = logging.getLogger(__name__)


def manifest_path(data_dir: Path, rank: int) -> Path:
    return data_dir / f"manifest_rank_{rank:05d}.json"


def file_plan_for(plan: RankPlan) -> FilePlan:
    items = [(c.key, c.data.dtype, tuple(c.box.shape)) for c in plan.chunks]
    return plan_file(items, {"format": "pt", "nxd_ckpt_format_version": str(FORMAT_VERSION)})


def _ordered_chunks(plan: RankPlan, file_plan: FilePlan) -> list[WriteChunk]:
    by_key = {chunk.key: chunk for chunk in plan.chunks}
    return [by_key[entry.key] for entry in file_plan.entries]


@dataclass
class DeferredCopy:
    """A chunk an async save copies after returning (``async_copy="before_step"``)."""

    name: str
    target: torch.Tensor
    source: torch.Tensor
    version: int
    """``source._version`` at save time: any in-place change since bumps it."""


def copy_deferred(copies: list[DeferredCopy]) -> None:
    """Copy the deferred chunks into the host buffer, then check that none was changed in
    place since the save call (a torn snapshot is an error naming the tensor)."""
    for copy in copies:
        copy_into(copy.target, copy.source)
    changed = sorted({copy.name for copy in copies if copy.source._version != copy.version})
    if changed:
        more = f" and {len(changed) - 10} more" if len(changed) > 10 else ""
        raise RuntimeError(
            f"async checkpoint (async_copy='before_step'): {changed[:10]}{more} changed in "
            f"place after save_checkpoint returned and before they were copied, outside an "
            f"optimizer step; the checkpoint would not be a snapshot and was not written. "
            f"Change them only in optimizer steps while such a save is pending, or use "
            f"async_copy='before_return'"
        )


class StagingBuffer:
    """One host buffer a rank's chunks are copied into for an async save (pinned when the
    data is on CUDA); reused by later saves of the same or a smaller size."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._layout: tuple = ()
        self._views: list[torch.Tensor] = []
        """Views of the buffer for the last layout: a training loop saves the same one."""

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        self._buffer, self._layout, self._views = None, (), []

    def _views_for(self, file_plan: FilePlan) -> list[torch.Tensor]:
        if file_plan.entries != self._layout:
            buffer = self._buffer
            assert buffer is not None
            self._views = [
                buffer[e.begin : e.end].view(e.dtype).view(e.shape) for e in file_plan.entries
            ]
            self._layout = file_plan.entries
        return self._views

    def stage(
        self, plan: RankPlan, file_plan: FilePlan, *, defer: bool = False
    ) -> tuple[list[torch.Tensor], list[DeferredCopy]]:
        """Views of the buffer holding every chunk, in file order, and the copies left to do.

        Every chunk is copied now (the blocking part of an async save), except, with
        ``defer``, the CPU chunks of tensors only optimizer steps change (``stable``): those
        are returned as :class:`DeferredCopy` for the save thread (before the next step).
        """
        on_cuda = any(c.data.device.type == "cuda" for c in plan.chunks)
        if self._buffer is None or self._buffer.numel() < file_plan.data_size:
            self.release()  # free the old one first: peak stays one buffer
            self._buffer = torch.empty(
                max(file_plan.data_size, 1), dtype=torch.uint8, pin_memory=on_cuda
            )
        views, deferred = list(self._views_for(file_plan)), []
        for target, chunk in zip(views, _ordered_chunks(plan, file_plan)):
            if defer and chunk.stable and chunk.data.device.type == "cpu":
                name = f"{chunk.category} {chunk.name}"
                deferred.append(DeferredCopy(name, target, chunk.data, chunk.data._version))
            elif on_cuda:
                target.copy_(chunk.data, non_blocking=True)
            else:
                copy_into(target, chunk.data)
        if on_cuda:
            torch.cuda.synchronize()
        return views, deferred


def _writable_as_is(data: torch.Tensor) -> bool:
    return data.device.type == "cpu" and data.is_contiguous()


def _host_copy(data: torch.Tensor) -> Any:
    return lambda: data.detach().to("cpu").contiguous()


def write_rank(
    plan: RankPlan,
    tag_dir: Path,
    data_dir: Path,
    file_plan: FilePlan | None = None,
    staged: list[torch.Tensor] | None = None,
) -> Path:
    """Write this rank's data file (if it has chunks) and then its manifest."""
    ctx = plan.ctx
    manifest: dict[str, Any] = {
        "rank": ctx.rank,
        "tp_rank": ctx.tp_rank,
        "pp_rank": ctx.pp_rank,
        "dp_rank": ctx.dp_rank,
        "declared": plan.declared,
        "aliases": plan.aliases,
        "meta": plan.meta,
        "chunks": [],
        "file": None,
    }
    if plan.chunks:
        file_plan = file_plan or file_plan_for(plan)
        relative = f"{data_dir.name}/{ctx.coordinates}.safetensors"
        if staged is None:  # sync: CPU data as it is, else one host copy at a time
            sources: list[Any] = [
                c.data.detach() if _writable_as_is(c.data) else _host_copy(c.data)
                for c in _ordered_chunks(plan, file_plan)
            ]
        else:
            sources = list(staged)
        digest = write_planned(tag_dir / relative, file_plan, sources)
        manifest["file"] = {
            "path": relative,
            "record": FileRecord(
                digest.size,
                digest.crc32,
                digest.header_crc32,
                ctx.rank,
                ctx.tp_rank,
                ctx.pp_rank,
                ctx.dp_rank,
            ).__dict__,
        }
        manifest["chunks"] = _chunk_records(plan, relative, file_plan, digest)
    path = manifest_path(data_dir, ctx.rank)  # read by rank 0 now, folded into the index:
    write_text_atomic(path, json.dumps(manifest), durable=False)  # atomic, no fsync needed
    return path


def _chunk_records(
    plan: RankPlan, relative: str, file_plan: FilePlan, digest: FileDigest
) -> list[dict[str, Any]]:
    """The manifest's record of each chunk written: where it lies in its global tensor, its
    block in the file ``relative`` and that block's CRCs."""
    ctx = plan.ctx
    entries = {entry.key: entry for entry in file_plan.entries}
    return [
        {
            "category": chunk.category,
            "name": chunk.name,
            "file": relative,
            "key": chunk.key,
            "offsets": list(chunk.box.offsets),
            "shape": list(chunk.box.shape),
            "crc32": digest.block_crcs[chunk.key],
            "crc_rows": entries[chunk.key].crc_rows,
            "tp_rank": ctx.tp_rank,
            "pp_rank": ctx.pp_rank,
            "dp_rank": ctx.dp_rank,
        }
        for chunk in plan.chunks
    ]


def _merge_optimizer(target: dict[str, Any] | None, meta: dict[str, Any]) -> dict[str, Any]:
    if target is None:
        return json.loads(json.dumps(meta))
    for index, group in enumerate(meta["param_groups"]):
        if index >= len(target["param_groups"]):
            target["param_groups"].append(group)
            continue
        known = target["param_groups"][index]["params"]
        known.extend(name for name in group["params"] if name not in known)
    for name, scalars in meta["scalars"].items():
        target["scalars"].setdefault(name, scalars)
    target["master_weights"] = target["master_weights"] or meta["master_weights"]
    return target


def merge_manifests(
    data_dir: Path, world_size: int, tag: str, save_id: str, parallel: dict[str, Any]
) -> CheckpointIndex:
    """The index of a save from every rank's manifest (rank 0, after all are written)."""
    index = CheckpointIndex(tag=tag, save_id=save_id, parallel=parallel)
    seen: dict[tuple[str, str], set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for rank in range(world_size):
        manifest = json.loads(manifest_path(data_dir, rank).read_text())
        if manifest["file"] is not None:
            index.files[manifest["file"]["path"]] = FileRecord(**manifest["file"]["record"])
        _merge_declared(index, manifest["declared"], rank)
        for category, aliases in manifest["aliases"].items():
            index.aliases.setdefault(category, {}).update(aliases)
        _merge_chunks(index, manifest["chunks"], seen)
        _merge_meta(index, manifest["meta"])
    _check_complete(index)
    return index


def _merge_declared(index: CheckpointIndex, declared: dict[str, Any], rank: int) -> None:
    """Add the tensors one rank declares; every rank must agree on their shape and dtype."""
    for category, entries in declared.items():
        tensors = index.tensors.setdefault(category, {})
        for name, entry in entries.items():
            record = tensors.get(name)
            if record is None:
                tensors[name] = TensorRecord(entry["shape"], entry["dtype"], [], entry["sharding"])
            elif record.shape != entry["shape"] or record.dtype != entry["dtype"]:
                raise FormatError(
                    f"ranks disagree on {category} tensor {name!r}: shape/dtype "
                    f"{record.shape}/{record.dtype} vs {entry['shape']}/{entry['dtype']} "
                    f"(rank {rank})"
                )


def _merge_chunks(
    index: CheckpointIndex,
    chunks: list[dict[str, Any]],
    seen: dict[tuple[str, str], set[tuple[tuple[int, ...], tuple[int, ...]]]],
) -> None:
    """Add one rank's chunks; a box another rank already wrote (a replica) is kept once."""
    for chunk in chunks:
        category, name = chunk.pop("category"), chunk.pop("name")
        box = (tuple(chunk["offsets"]), tuple(chunk["shape"]))
        boxes = seen.setdefault((category, name), set())
        if box in boxes:  # the same replica written twice (tied across stages): keep one
            continue
        boxes.add(box)
        index.tensors[category][name].chunks.append(ChunkRecord(**chunk))


def _merge_meta(index: CheckpointIndex, meta: dict[str, Any]) -> None:
    """Add one rank's non-tensor content: optimizer metadata, scheduler, user content."""
    if "optimizer" in meta:
        index.optimizer = _merge_optimizer(index.optimizer, meta["optimizer"])
    for key in ("scheduler", "scheduler_class", "user_content", "hf_config", "lora"):
        if key in meta:
            setattr(index, key, meta[key])
    for key in ("has_scheduler", "has_user_content"):
        if meta.get(key):
            setattr(index, key, True)


def _check_complete(index: CheckpointIndex) -> None:
    """Every tensor fully written; an alias that some rank stored under its own name is not
    an alias."""
    for category, tensors in index.tensors.items():
        for name, record in tensors.items():
            stored = sum(math.prod(c.shape) for c in record.chunks)
            if stored != math.prod(record.shape):
                raise FormatError(
                    f"{category} tensor {name!r} of shape {record.shape}: the ranks wrote "
                    f"{stored} of its {math.prod(record.shape)} elements (replicas that differ "
                    f"in layout across ranks?)"
                )
        for alias in list(index.aliases.get(category, {})):
            if alias in tensors:  # stored under that name by some rank: not an alias
                del index.aliases[category][alias]
