"""Where each parallel parameter's values come from, and reading only this rank's part.

A parallelised model's tensor is a piece of an original (Hugging Face) tensor ``W``:

* ``whole``: all of ``W`` (replicated tensors: norms, biases of row-parallel layers);
* ``shard``: along ``dim``, the ``rank``-th of ``size`` equal chunks of ``W`` zero-padded to
  ``padded`` (a vocabulary not divisible by TP): chunk ``[r·n, (r+1)·n)`` with
  ``n = padded / size``; only its real part ``[r·n, min((r+1)·n, len))`` is read;
* ``rows``: the listed rows of ``W`` (GQA K/V heads replicated ``kv_size_multiplier`` times:
  a rank's rows are copies of a few original heads), read as runs of consecutive rows;
* ``blocks``: boxes of ``W`` (a ``[start, stop)`` per leading dim, the other dims whole),
  concatenated along ``dim``: packed MoE experts, ``W[e0:e1, gate rows] ++ W[e0:e1, up rows]``
  (this EP rank's experts, this TP rank's gate and up features).

The original tensors are read from a *store*: the model's own tensors in memory (an eagerly
built model) or a Hugging Face folder's safetensors files, where ``get_slice`` reads only the
requested rows/columns. Packed MoE experts (transformers' ``gate_up_proj`` / ``down_proj``) are
stored per expert in a Hugging Face folder (``save_pretrained`` and the Hub write them so):
:class:`PackedExperts` reads the box a rank asks for from the experts' own tensors, so a rank
reads only its experts' rows. A file is opened per tensor and closed after it (safetensors maps the
file: pages it touched count as this process's memory until it is unmapped), so a rank's
memory holds its shards plus at most one original tensor's touched pages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["FolderStore", "MemoryStore", "PackedExperts", "Source", "Store", "stored_per_expert"]

logger = logging.getLogger(__name__)

HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Source:
    """This rank's piece of the original tensor ``name`` (see the module docstring)."""

    name: str
    kind: str = "whole"
    """``"whole"``, ``"shard"``, ``"rows"`` or ``"blocks"``."""
    dim: int = 0
    rank: int = 0
    size: int = 1
    padded: int | None = None
    """Length of ``dim`` after padding (``shard``; None: no padding)."""
    rows: tuple[int, ...] = ()
    """Original rows, in local order (``rows``)."""
    blocks: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Boxes of ``W``, one ``(start, stop)`` per leading dim each, concatenated along ``dim``
    (``blocks``)."""
    memory: bool = False
    """Read from the in-memory store even when a folder is given (non-persistent buffers)."""

    def read(self, view: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """The piece, from ``view`` (a tensor or a safetensors slice) of ``W`` of ``shape``."""
        if self.kind == "whole":
            return view[...] if not shape else view[:]
        if self.kind == "rows":
            return torch.cat([view[a:b] for a, b in _runs(self.rows)], dim=0)
        if self.kind == "blocks":
            boxes = [view[tuple(slice(a, b) for a, b in box)] for box in self.blocks]
            return torch.cat(boxes, dim=self.dim)
        length = shape[self.dim]
        padded = self.padded if self.padded is not None else length
        n = padded // self.size
        start, stop = self.rank * n, (self.rank + 1) * n
        real = min(stop, length)
        index = [slice(None)] * len(shape)
        index[self.dim] = slice(start, real)
        piece = view[tuple(index)] if real > start else None
        local = list(shape)
        local[self.dim] = n
        if piece is not None and real - start == n:
            return piece
        out = torch.zeros(local, dtype=piece.dtype if piece is not None else torch.float32)
        if piece is not None:
            out.narrow(self.dim, 0, real - start).copy_(piece)
        return out


def _runs(rows: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """Consecutive runs ``[a, b)`` of ``rows`` in order."""
    start = prev = rows[0]
    for row in rows[1:]:
        if row != prev + 1:
            yield start, prev + 1
            start = row
        prev = row
    yield start, prev + 1


class Store:
    """Original tensors by name."""

    def has(self, name: str) -> bool:
        raise NotImplementedError

    @contextmanager
    def view(self, name: str) -> Iterator[tuple[Any, tuple[int, ...]]]:
        """``(view, shape)`` of tensor ``name`` while the context is open."""
        raise NotImplementedError
        yield  # pragma: no cover


class MemoryStore(Store):
    """The tensors of a model built eagerly (full, on the host or device)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    @contextmanager
    def view(self, name: str) -> Iterator[tuple[Any, tuple[int, ...]]]:
        tensor = self.tensors[name]
        yield tensor.detach(), tuple(tensor.shape)


class FolderStore(Store):
    """A Hugging Face folder: ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json`` (every listed shard must exist, named by a path inside
    the folder: an absolute name or one with ``..`` is refused, as nxd-ckpt's
    :func:`~nxd_ckpt.hf.hf_weight_files` does; the files may be links, as in the Hugging
    Face cache)."""

    def __init__(self, folder: str | Path) -> None:
        from nxd_ckpt.hf import hf_weight_files

        self.folder = Path(folder)
        index = self.folder / HF_INDEX_NAME
        if index.is_file():
            hf_weight_files(self.folder)  # the index's file names stay inside the folder
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.folder / HF_WEIGHTS_NAME).is_file():
            weight_map = {name: HF_WEIGHTS_NAME for name in _keys(self.folder / HF_WEIGHTS_NAME)}
        else:
            raise FileNotFoundError(
                f"{self.folder} is not a Hugging Face checkpoint folder: it has neither "
                f"{HF_WEIGHTS_NAME} nor {HF_INDEX_NAME}"
            )
        missing = sorted({f for f in weight_map.values() if not (self.folder / f).is_file()})
        if missing:
            raise FileNotFoundError(
                f"{self.folder}: the checkpoint is missing shard files {missing} listed in "
                f"{HF_INDEX_NAME}"
            )
        self.weight_map = weight_map

    def has(self, name: str) -> bool:
        return name in self.weight_map or stored_per_expert(self.weight_map, name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of stored tensor ``name``, from its file's header (no data read)."""
        path = self.folder / self.weight_map[name]
        with _opened(path) as handle:
            return tuple(handle.get_slice(name).get_shape())

    @contextmanager
    def view(self, name: str) -> Iterator[tuple[Any, tuple[int, ...]]]:
        if name not in self.weight_map:
            stored = stored_per_expert(self.weight_map, name)
            if stored is None:
                raise KeyError(f"{self.folder} holds no tensor {name!r}")
            if isinstance(stored, str):  # Mixtral's router, under its saved name
                with self.view(stored) as (view, shape):
                    yield view, shape
                return
            packed = PackedExperts(self, stored)
            yield packed, packed.shape
            return
        path = self.folder / self.weight_map[name]
        with _opened(path) as handle:
            if name not in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                raise KeyError(f"{path} does not hold {name!r} (its index says it does)")
            view = handle.get_slice(name)
            yield view, tuple(view.get_shape())


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """``safe_open(path)``; a damaged file is an error naming it (safetensors' own errors
    do not)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
    with handle:
        yield handle


def _keys(path: Path) -> list[str]:
    with _opened(path) as handle:
        return list(handle.keys())


def stored_per_expert(weight_map: dict[str, str], name: str) -> str | list[list[str]] | None:
    """How a folder stores the model's tensor ``name`` that it does not hold under that name:
    Mixtral's router ``<layer>.mlp.gate.weight`` as ``<layer>.block_sparse_moe.gate.weight``
    (that name), a packed ``<layer>.mlp.experts.gate_up_proj`` / ``down_proj`` per expert (per
    expert ``e``: its gate and up tensors, or its down tensor; the experts numbered from 0 with
    none missing), else None."""
    from nxd_trainer.hf._expert_export import DOWN, GATE_UP, PER_EXPERT, ROUTER

    if name.endswith(ROUTER):
        alias = f"{name[: -len(ROUTER)]}.block_sparse_moe.gate.weight"
        return alias if alias in weight_map else None
    for suffix, parts in ((GATE_UP, (0, 1)), (DOWN, (2,))):
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)]
        for block, projections in {v for v in PER_EXPERT.values()}:
            names = [f"{prefix}.{block}.experts.{{e}}.{projections[i]}.weight" for i in parts]
            experts: list[list[str]] = []
            while all(n.format(e=len(experts)) in weight_map for n in names):
                experts.append([n.format(e=len(experts)) for n in names])
            if experts:
                return experts
    return None


class PackedExperts:
    """A packed experts tensor of a folder that stores it per expert, read by boxes:
    ``gate_up_proj`` ``(E, 2I, H)`` from each expert's gate ``(I, H)`` and up ``(I, H)``
    (rows ``[G_e; U_e]``), ``down_proj`` ``(E, H, I)`` from each expert's down ``(H, I)``.
    Indexing with slices (step 1) reads only the requested experts, rows and columns."""

    def __init__(self, store: FolderStore, experts: list[list[str]]) -> None:
        self.store, self.experts = store, experts
        shapes = {store.shape(name) for name in experts[0]}  # the others checked when read
        (shape,) = shapes if len(shapes) == 1 else (None,)
        if shape is None or len(shape) != 2:
            raise ValueError(
                f"{store.folder}: the expert tensors {experts[0]} have shapes {sorted(shapes)}, "
                f"expected one 2-D shape"
            )
        self.part = shape
        self.shape = (len(experts), shape[0] * len(experts[0]), shape[1])

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis:
            index = ()
        if not isinstance(index, tuple):
            index = (index,)
        index = tuple(index) + (slice(None),) * (3 - len(index))
        bounds = []
        for dim, piece in enumerate(index):
            if not isinstance(piece, slice):
                raise TypeError(f"PackedExperts takes slices, got {piece!r}")
            start, stop, step = piece.indices(self.shape[dim])
            if step != 1:
                raise ValueError(f"PackedExperts reads slices of step 1, got {piece!r}")
            bounds.append((start, max(start, stop)))
        (e0, e1), (r0, r1), (c0, c1) = bounds
        out = []
        for names in self.experts[e0:e1]:
            pieces = []
            for part, name in enumerate(names):  # rows [part * n, (part + 1) * n) of the expert
                base = part * self.part[0]
                a, b = max(r0, base) - base, min(r1, base + self.part[0]) - base
                if b > a:
                    with self.store.view(name) as (view, shape):
                        if shape != self.part:
                            raise ValueError(
                                f"{self.store.folder}: {name} has shape {shape}, "
                                f"{self.experts[0][part]} {self.part}: experts differ"
                            )
                        pieces.append(view[a:b, c0:c1])
            out.append(torch.cat(pieces, dim=0))
        if not out:
            raise ValueError("PackedExperts: an empty box of experts")
        return torch.stack(out)
