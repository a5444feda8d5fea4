"""Loading model tensors (any TP/PP/DP layout), RNG states and JSON content from a tag.

Each local tensor is filled block by block: a block of the local tensor equals a box of the
global tensor, which the reader assembles from the stored chunks it intersects. Key checks
are collective: a name is *unexpected* only if no rank's model holds it (a pipeline stage
holds part of the names), counted with one all-reduce.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.format import _jsonstate
from nxd_ckpt.format._boxes import Box
from nxd_ckpt.format._stfile import dtype_from_name
from nxd_ckpt.layout._context import RankContext, agree, sum_counts
from nxd_ckpt.layout._items import DenseSource, TensorItem, pieces
from nxd_ckpt.layout._model_tensors import model_tensors
from nxd_ckpt.layout._sharding import rank_local_name, shape_mismatch, spec_for_stored_shape
from nxd_ckpt.load._reader import CheckpointReader

__all__ = [
    "ModelReads",
    "check_keys",
    "exact_cast",
    "json_paths",
    "load_json",
    "load_model",
    "load_rng",
    "model_reads",
    "rng_names",
]

logger = logging.getLogger(__name__)
_LIST_LIMIT = 20


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    more = f" … and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return f"[{shown}{more}]"


def exact_cast(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of dtype ``stored`` is a value of ``target``: the same dtype, a
    float widened (bf16 or fp16 -> fp32 -> fp64: at least the precision ``eps`` and the range
    ``max``/``tiny``), an integer widened, an integer of at most ``target``'s significand
    bits into a float, a bool into anything. Narrowing (fp32 -> bf16, bf16 <-> fp16), float
    -> integer and complex (unless the same dtype) are not."""
    if stored == target or stored == torch.bool:
        return True
    if stored.is_complex or target.is_complex or target == torch.bool:
        return False
    if stored.is_floating_point:
        if not target.is_floating_point:
            return False
        have, want = torch.finfo(stored), torch.finfo(target)
        return want.eps <= have.eps and want.max >= have.max and want.tiny <= have.tiny
    have_int = torch.iinfo(stored)
    if target.is_floating_point:
        digits = 1 - round(math.log2(torch.finfo(target).eps))  # significand bits
        return max(have_int.max, -have_int.min) <= 2**digits
    want_int = torch.iinfo(target)
    return want_int.min <= have_int.min and want_int.max >= have_int.max


def check_keys(
    what: str,
    stored_names: list[str],
    used: set[str],
    missing: list[str],
    mismatched: list[str],
    strict: bool,
    source: str,
) -> None:
    """Raise on every rank for shape mismatches, and under ``strict`` for missing names
    (local) or stored names no rank uses (collective)."""
    counts = sum_counts([int(name in used) for name in stored_names])
    unexpected = [name for name, count in zip(stored_names, counts) if count == 0]
    problems = []
    if mismatched:
        problems.append(f"shape mismatch: {_listing(mismatched)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_listing(sorted(missing))}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the {what}: {_listing(unexpected)}")
    error = None
    if problems:
        error = ValueError(f"loading {what} from {source}: " + "; ".join(problems))
    agree(error, f"loading {what}")
    if missing or unexpected:
        logger.warning(
            "loading %s (strict=False): %d missing, %d unexpected",
            what,
            len(missing),
            len(unexpected),
        )


@dataclass
class ModelReads:
    """The model tensors this rank fills: (local tensor, stored name, spec) after the key
    checks; :meth:`boxes` lists the global boxes they read, :meth:`fill` copies them in."""

    requested: list[tuple[Any, str, Any]]

    def items(self) -> Iterator[tuple[Any, TensorItem]]:
        for local, target, spec in self.requested:
            item = TensorItem("model", target, local.tensor.dtype, spec, DenseSource(local.tensor))
            yield local, item

    def boxes(self) -> Iterator[tuple[str, str, Box]]:
        for _, item in self.items():
            for piece in pieces(item):
                yield "model", item.name, piece.global_box

    @torch.no_grad()
    def fill(self, reader: CheckpointReader) -> None:
        for local, item in self.items():
            if item.spec.padded is not None:  # padding (zeros) is stored nowhere: zero it
                local.tensor.zero_()
            for piece in pieces(item):
                reader.read_box("model", item.name, piece.global_box, out=piece.local)


def model_reads(model: Any, reader: CheckpointReader, ctx: RankContext, strict: bool) -> ModelReads:
    """Match ``model``'s tensors with the tag's (the key checks are collective)."""
    tensors, aliases = model_tensors(model, ctx, for_load=True)
    index = reader.index
    stored = index.category("model")
    requested, missing, mismatched, rounded, used = [], [], [], [], set()
    names = set(index.names("model"))
    for local in tensors:
        for part, part_spec in local.stored_in(names):  # its own name, or its stored parts
            name = rank_local_name(part, ctx) if part_spec.rank_local else part
            target = index.resolve("model", name)
            record = stored.get(target)
            if record is None:
                missing.append(name)
                continue
            used.add(target)
            spec = spec_for_stored_shape(part_spec, tuple(record.shape))
            if spec is None:
                mismatched.append(shape_mismatch(part, part_spec, tuple(record.shape)))
                continue
            if not exact_cast(dtype_from_name(record.dtype), local.tensor.dtype):
                held = str(local.tensor.dtype).removeprefix("torch.")
                rounded.append(f"{part}: checkpoint {record.dtype}, model {held}")
            requested.append((local, target, spec))
    for alias, first in aliases.items():  # tied names: present in the checkpoint or not
        target = index.resolve("model", alias)
        if target in stored:
            used.add(target)
        elif first in stored or index.resolve("model", first) in stored:
            continue
        else:
            missing.append(alias)
    source = str(reader.tag_dir)
    check_keys("model", sorted(stored), used, missing, mismatched, strict, source)
    if rounded:  # as load_state_dict casts (fine-tuning an fp32 tag in bf16), but said
        logger.warning(
            "loading model from %s: %d tensor(s) rounded to the model's dtype, which cannot "
            "hold every stored value (load into a model of the stored dtype to keep them "
            "exact): %s",
            source,
            len(rounded),
            _listing(rounded),
        )
    return ModelReads(requested)


def load_model(
    model: Any,
    reader: CheckpointReader,
    ctx: RankContext,
    strict: bool,
    slot: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Fill ``model``'s tensors from the tag (checks are collective, reads under ``slot``)."""
    reads = model_reads(model, reader, ctx, strict)
    with slot():
        reads.fill(reader)


def rng_names(reader: CheckpointReader, ctx: RankContext) -> list[str]:
    """This rank's stored RNG states, if the checkpoint was saved at the same layout."""
    saved = reader.index.parallel
    now = ctx.parallel_dict(zero1=bool(saved.get("zero1")))
    defaults = {"expert_model_parallel_size": 1}  # not recorded before EP > 1 was saved
    same = all(saved.get(k, defaults.get(k)) == now[k] for k in now if k != "zero1")
    prefix = f"rank{ctx.rank:05d}/"
    names = [n for n in reader.index.category("rng") if n.startswith(prefix)]
    if not same or not names:
        logger.info("RNG states not restored: saved at %s, loading at %s", saved, now)
        return []
    return names


def load_rng(reader: CheckpointReader, ctx: RankContext) -> bool:
    """Restore this rank's RNG states if the checkpoint was saved at the same layout."""
    import nxd_state

    prefix = f"rank{ctx.rank:05d}/"
    names = rng_names(reader, ctx)
    if not names:
        return False
    states = {name[len(prefix) :]: reader.read_full("rng", name) for name in names}
    nxd_state.load_rng_state_dict(states)
    return True


def load_json(reader: CheckpointReader, category: str) -> Any:
    """The scheduler state or user content, with its tensors read back."""
    encoded = getattr(reader.index, category)
    paths = json_paths(reader, category)
    tensors = {path: reader.read_full(category, path) for path in paths}
    return _jsonstate.decode(encoded, tensors)


def json_paths(reader: CheckpointReader, category: str) -> list[str]:
    """The stored tensors of the scheduler state or user content."""
    return _jsonstate.tensor_paths(getattr(reader.index, category))
