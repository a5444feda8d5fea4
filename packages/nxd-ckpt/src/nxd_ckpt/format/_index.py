"""The index of a tag (``index.json``): :class:`CheckpointIndex` and :func:`read_index`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nxd_ckpt.format._contain import open_regular
from nxd_ckpt.format._records import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    FileRecord,
    FormatError,
    TensorRecord,
)
from nxd_ckpt.format._validate import parse_index

__all__ = ["CheckpointIndex", "read_index"]


@dataclass
class CheckpointIndex:
    """Everything a tag holds; ``index.json``."""

    tag: str
    save_id: str
    parallel: dict[str, Any]
    """``world_size``, ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``data_parallel_size``, ``expert_model_parallel_size`` (absent before nxd-ckpt saved at
    EP > 1: 1), ``zero1`` at save time."""
    files: dict[str, FileRecord] = field(default_factory=dict)
    tensors: dict[str, dict[str, TensorRecord]] = field(default_factory=dict)
    """Category (``model``, ``optimizer``, ``rng``, ``scheduler``, ``user_content``) -> name."""
    aliases: dict[str, dict[str, str]] = field(default_factory=dict)
    """Category -> name -> the name whose data it shares (tied weights)."""
    optimizer: dict[str, Any] | None = None
    """``class``, ``param_groups`` (hyper-parameters and parameter names), ``scalars`` (per
    parameter name, non-tensor state such as ``step``), ``zero1``, ``master_weights``."""
    scheduler: Any = None
    """The scheduler's state dict as JSON (tensors replaced by references)."""
    user_content: Any = None
    """The user content as JSON (tensors replaced by references)."""
    has_scheduler: bool = False
    has_user_content: bool = False
    scheduler_class: str | None = None
    """The saved scheduler's class name (None: saved before it was recorded); a load into a
    scheduler of another class is refused before anything is loaded."""
    lora: dict[str, Any] | None = None
    """For a LoRA model: the save mode and the adapter configuration."""
    hf_config: dict[str, Any] | None = None
    """A Hugging Face ``config.json`` to write on export, when the model had one."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        document = asdict(self)
        if document["scheduler_class"] is None:  # (indexes without it stay readable by
            del document["scheduler_class"]  # nxd-ckpt releases that predate the field)
        return json.dumps(document, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any, source: str = "index") -> CheckpointIndex:
        """Parse and validate a native index (:mod:`nxd_ckpt.format._validate`): every field's type,
        contained file names, chunks that tile each tensor exactly, sizes bounded by the
        files, a CRC for every block, known dtypes, the JSON content's tensor references.
        Any problem is a :class:`FormatError` naming ``source`` and the field."""
        return parse_index(cls, data, source)

    def category(self, name: str) -> dict[str, TensorRecord]:
        return self.tensors.get(name, {})

    def resolve(self, category: str, name: str) -> str:
        """``name``, or the name it is an alias of."""
        return self.aliases.get(category, {}).get(name, name)

    def names(self, category: str) -> list[str]:
        """Every name a model may ask for: stored tensors and aliases."""
        return [*self.category(category), *self.aliases.get(category, {})]


def read_index(tag_dir: Path) -> CheckpointIndex:
    """Parse and validate ``tag_dir/index.json`` (clear errors for a missing, foreign,
    damaged or hostile index; ``index.json`` must not be a symbolic link)."""
    path = Path(tag_dir) / INDEX_NAME
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} does not exist: {tag_dir} is not an nxd-ckpt tag"
        ) from None
    try:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read()
    except OSError as error:
        raise FormatError(f"{path} cannot be read: {error}") from error
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FormatError(f"{path} is not valid JSON: {error}") from error
    except RecursionError:
        raise FormatError(f"{path} is nested too deeply to be an nxd-ckpt index") from None
    return CheckpointIndex.from_dict(data, str(path))
