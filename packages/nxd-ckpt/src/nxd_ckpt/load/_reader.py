"""Read boxes of global tensors from a tag: intersect with the stored chunks, read those.

For a requested box R of tensor T, every chunk C of T with R ∩ C ≠ ∅ contributes
``C[(R ∩ C) - C.offsets]`` to ``out[(R ∩ C) - R.offsets]``; chunks are disjoint, so the
request is complete exactly when the intersections' volumes add up to R's (checked). Only
the rows of each chunk that R needs are read (widened to the chunk's CRC blocks). Every file
is opened inside the tag folder only (:mod:`nxd_ckpt.format._contain`: no link followed, names
checked) and checked against its record and the chunks' shapes and dtypes
(:mod:`nxd_ckpt.format._stread`). :meth:`CheckpointReader.close` closes the files it opened.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nxd_ckpt.format import (
    CheckpointIndex,
    ContainmentError,
    FormatError,
    TensorRecord,
    read_index,
)
from nxd_ckpt.format._boxes import Box
from nxd_ckpt.format._contain import check_relative, no_links_below
from nxd_ckpt.format._stfile import dtype_from_name
from nxd_ckpt.format._stread import FileReader

__all__ = ["CheckpointReader", "DamagedFileError", "LinkedFileError", "damaged"]

logger = logging.getLogger(__name__)


class DamagedFileError(FormatError):
    """A data file is missing, truncated or fails a checksum; ``file``: its path in the tag."""

    def __init__(self, file: str, message: str) -> None:
        super().__init__(message)
        self.file = file


class LinkedFileError(DamagedFileError, ContainmentError):
    """A data file (or a folder on its way) is a link, or named outside the tag."""


def damaged(file: str, error: BaseException) -> DamagedFileError:
    """The error to raise for ``file``, keeping a containment problem one."""
    kind = LinkedFileError if isinstance(error, ContainmentError) else DamagedFileError
    return kind(file, str(error))


class CheckpointReader:
    """An open tag: its index and lazily opened, verified data files."""

    def __init__(
        self,
        tag_dir: Path,
        *,
        verify: bool = True,
        index: CheckpointIndex | None = None,
        sources: dict[str, Any] | None = None,
        follow_links: bool = False,
    ) -> None:
        """``index``: an index built in memory for foreign files (a Hugging Face folder,
        NxD's layout), whose files have no records and chunks no CRCs; by default
        ``tag_dir/index.json`` (validated: :mod:`nxd_ckpt.format._validate`). ``sources``: readers
        (``read(chunk, box)``) standing in for named files (NxD's pickled ``.pt`` files).
        ``follow_links``: files may be links (a Hugging Face folder: its cache is made of
        them); names are checked to stay inside either way."""
        self.tag_dir = Path(tag_dir)
        self.index: CheckpointIndex = index if index is not None else read_index(self.tag_dir)
        self._foreign = index is not None
        self.verify = verify
        self.follow_links = follow_links
        self._files: dict[str, Any] = dict(sources or {})
        self._opened: list[FileReader] = []
        self.bytes_read = 0

    def close(self) -> None:
        """Close the data files opened so far (a later read opens them again)."""
        for reader in self._opened:
            reader.close()
            self._files = {k: v for k, v in self._files.items() if v is not reader}
        self._opened = []

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, category: str, name: str) -> TensorRecord:
        stored = self.index.resolve(category, name)
        try:
            return self.index.tensors[category][stored]
        except KeyError:
            raise KeyError(f"{category} tensor {name!r} is not in {self.tag_dir}") from None

    def has(self, category: str, name: str) -> bool:
        return self.index.resolve(category, name) in self.index.category(category)

    def _file(self, relative: str) -> Any:
        reader = self._files.get(relative)
        if reader is None:
            record = self.index.files.get(relative)
            if record is None and not self._foreign:
                raise FormatError(f"{self.tag_dir}: the index names no file {relative!r}")
            name = check_relative(relative, str(self.tag_dir))
            path = self.tag_dir / name  # a Hugging Face folder: names checked, links followed
            if not self.follow_links:
                path = no_links_below(self.tag_dir, name)
            reader = FileReader(path, record, verify=self.verify, follow=self.follow_links)
            self._files[relative] = reader
            self._opened.append(reader)
        return reader

    def read_box(
        self, category: str, name: str, box: Box, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``T[box]`` of tensor ``name``, in the saved dtype unless ``out`` is given (then
        copied into ``out``, cast to its dtype and device, and returned)."""
        record = self.record(category, name)
        if len(box.shape) != len(record.shape) or not Box.whole(record.shape).contains(box):
            raise ValueError(
                f"{category} tensor {name!r}: box {box} is outside its shape {record.shape}"
            )
        if out is None:
            out = torch.empty(box.shape, dtype=dtype_from_name(record.dtype))
        elif tuple(out.shape) != box.shape:
            raise ValueError(f"{name}: out has shape {tuple(out.shape)}, box {box.shape}")
        for common, data in self._parts(category, name, box):
            out[common.relative_to(box).slices()].copy_(data)
            self.bytes_read += data.numel() * data.element_size()
        return out

    def check_box(self, category: str, name: str, box: Box) -> None:
        """Read ``T[box]`` as :meth:`read_box` would and check it (sizes, headers, CRCs of
        the rows it covers, coverage), copying nothing: at most one chunk's rows are held.
        A damaged file raises :class:`DamagedFileError` naming it."""
        for _ in self._parts(category, name, box):
            pass

    def _parts(self, category: str, name: str, box: Box) -> Iterator[tuple[Box, torch.Tensor]]:
        """``(R ∩ C, data)`` for each stored chunk C that the box R meets; then checks that
        the intersections cover R."""
        record = self.record(category, name)
        if len(box.shape) != len(record.shape) or not Box.whole(record.shape).contains(box):
            raise ValueError(
                f"{category} tensor {name!r}: box {box} is outside its shape {record.shape}"
            )
        covered = 0
        for chunk in record.chunks:
            stored = Box(tuple(chunk.offsets), tuple(chunk.shape))
            common = box.intersect(stored)
            if common is None:
                continue
            try:
                source = self._file(chunk.file)
                if isinstance(source, FileReader):
                    data = source.read(chunk, common.relative_to(stored), record.dtype)
                else:
                    data = source.read(chunk, common.relative_to(stored))
            except (FormatError, OSError) as error:
                raise damaged(chunk.file, error) from error
            yield common, data
            covered += common.numel
        if covered != box.numel:
            raise FormatError(
                f"{self.tag_dir}: {category} tensor {name!r} has chunks covering {covered} of "
                f"the {box.numel} elements of {box}: the checkpoint is incomplete"
            )

    def read_full(self, category: str, name: str) -> torch.Tensor:
        return self.read_box(category, name, Box.whole(self.record(category, name).shape))

    def verify_files(self, *, data: bool = True) -> int:
        """Open every file (size, header CRC, every chunk's entry: shape, dtype, byte range)
        and, with ``data``, read every chunk and check its CRCs, one file at a time; returns
        the bytes of the files checked. A problem raises :class:`DamagedFileError`."""
        by_file: dict[str, list] = {}
        for tensors in self.index.tensors.values():
            for record in tensors.values():
                for chunk in record.chunks:
                    by_file.setdefault(chunk.file, []).append((chunk, record.dtype))
        total = 0
        for relative in self.index.files:
            try:
                reader = self._file(relative)
                chunks = by_file.get(relative, [])
                if data:
                    reader.verify_all(chunks)
                else:
                    for chunk, dtype in chunks:
                        reader.entry(chunk, dtype)
            except (FormatError, OSError) as error:
                raise damaged(relative, error) from error
            finally:
                self.close()
            total += self.index.files[relative].size
        return total
