"""The records of the on-disk format (:mod:`nxd_ckpt.format` documents the layout): its
names and version, its errors, and the records an index is made of. Pure data: the modules
that validate and contain an index import these without importing the index itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CATEGORIES",
    "DONE_MARKER",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "START_MARKER",
    "TAG_MARKER",
    "ChunkRecord",
    "ContainmentError",
    "FileRecord",
    "FormatError",
    "TensorRecord",
]

FORMAT_NAME = "nxd-ckpt"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
START_MARKER = "checkpoint"
DONE_MARKER = "done"
TAG_MARKER = "nxd-ckpt.json"
"""Written first into every tag nxd-ckpt creates: its format name and version. Retention
deletes only tags that carry it (or, written before it existed, a valid nxd-ckpt index)."""
CATEGORIES = ("model", "optimizer", "rng", "scheduler", "user_content")


class FormatError(ValueError):
    """A checkpoint's files do not match what its index promises (or the index is unreadable)."""


class ContainmentError(FormatError):
    """A checkpoint path leaves the checkpoint folder: a symbolic link below the folder the
    user named, an absolute file name or one with ``..`` in an index."""


@dataclass
class ChunkRecord:
    """One stored box of a global tensor."""

    file: str
    """Path of the safetensors file, relative to the tag folder."""
    key: str
    """The tensor's key inside that file."""
    offsets: list[int]
    """Where the box starts in the global tensor, per dimension."""
    shape: list[int]
    """The box's shape (the stored tensor's shape)."""
    crc32: list[int]
    """CRC-32 of each block of ``crc_rows`` rows (dim 0) of the stored bytes."""
    crc_rows: int
    """Rows per CRC block (1 for a 0-d tensor)."""
    tp_rank: int = 0
    """Coordinates of the rank that wrote it."""
    pp_rank: int = 0
    dp_rank: int = 0
    stored_offsets: list[int] | None = None
    """Where the box starts inside the stored tensor, when that tensor holds more than this
    box (foreign layouts such as NxD's per-rank files); None: the stored tensor is the box."""


@dataclass
class TensorRecord:
    """A global tensor: shape, dtype, how it was sharded when saved, and its chunks."""

    shape: list[int]
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``float32``, ``bfloat16`` …)."""
    chunks: list[ChunkRecord] = field(default_factory=list)
    sharding: dict[str, Any] = field(default_factory=dict)
    """As saved: ``partition_dim``, ``partition_stride``, ``tp_size``; ``layout: gqa_qkv`` with
    ``q_size``, ``kv_size``, ``kv_size_multiplier``, ``part`` for the GQA projection;
    ``padding`` (``dim``, ``unpadded_size``, ``padded_size``, ``layout``, ``tp_size``: an
    ``nxd_layers.TensorParallelPadding``) for a tensor padded by ``pad_model``, whose shape
    and chunks are those of the unpadded tensor; ``rank_local: true`` for tensors of unknown
    sharding (loadable at the same degrees only)."""


@dataclass
class FileRecord:
    """A data file: what its bytes must be."""

    size: int
    crc32: int
    header_crc32: int
    rank: int
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
