"""The inputs of an ``nxd-train`` run: what ``--data`` names, found and typed by content.

``--data`` is a file or a folder, each file recognised by its content (never by its
suffix alone): Parquet (``PAR1`` magic; the ``text_field`` column), JSON Lines (the first line
is a JSON object holding ``text_field``; a ``.jsonl``/``.ndjson``/``.json`` file whose first line
is an object without it is refused), text (no NUL byte in the first 8000 bytes, git's rule),
else binary (skipped in a folder); ``.git``/``.hg``/``.svn`` folders are skipped. A ``datasets``
folder (``save_to_disk``; a ``DatasetDict``'s ``train`` split, its ``validation``/``valid``/
``test`` split as the validation) and ``BUILDER:FILES`` (``datasets.load_dataset(BUILDER,
data_files=FILES)``, e.g. ``csv:tables/*.csv``) are read from their Arrow files. None: the Python
standard library's ``.py`` sources (found through ``sysconfig``; no download).

Each file becomes a :class:`Source` (kind, path, size, rows): of a file, only its first 8000
bytes and (Parquet/Arrow) its metadata are read here (``load_dataset`` itself first converts
its files into its Arrow cache).
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxd_trainer.train.config import ConfigError, TrainConfig

__all__ = ["TRAIN", "VALID", "Source", "arrow_batches", "check_data", "data_spec", "discover"]

TRAIN, VALID = 0, 1  # split indices
_SNIFF = 8000  # a file holding a NUL byte in its first 8000 bytes is binary (git's rule)
_SKIPPED_DIRS = {".git", ".hg", ".svn"}
_JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")


@dataclass(frozen=True)
class Source:
    """One input file and what of it is used.

    ``used`` is a byte offset (text, JSON Lines) or a row count (Parquet, Arrow); ``measure``
    the bytes it weighs (text: its bytes; records: their text's bytes, estimated from the
    column's size); ``rows`` its documents (text: 1; JSON Lines: lines).
    """

    kind: str  # "text" | "jsonl" | "parquet" | "arrow"
    path: str
    name: str
    used: int
    measure: int
    rows: int
    digest: str = ""
    crc: int = 0  # crc32 of a text file's used bytes (its split hash)
    split: int | None = None  # the split of the whole source (a DatasetDict's own split)


_SPEC = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):(?!//)(.+)$")


def data_spec(data: str) -> tuple[str, str] | None:
    """``(builder, files)`` of a ``BUILDER:FILES`` value (a path that exists is a path)."""
    if Path(data).expanduser().exists():
        return None
    match = _SPEC.match(data)
    return (match.group(1), match.group(2)) if match else None


def check_data(cfg: TrainConfig) -> None:
    """``--data`` names something that exists (before anything is written)."""
    if cfg.data is None:
        return
    spec = data_spec(cfg.data)
    if spec is not None:
        import glob

        if not glob.glob(os.path.expanduser(spec[1]), recursive=True):
            raise ConfigError(
                f"data {cfg.data!r}: no file matches {spec[1]!r} (for datasets.load_dataset"
                f"({spec[0]!r}, data_files=...))"
            )
        return
    if not Path(cfg.data).expanduser().exists():
        raise ConfigError(f"data path {cfg.data!r} does not exist")


def _sniff(path: Path, text_field: str) -> str:
    """``parquet``, ``jsonl``, ``text`` or ``binary``, by content."""
    with path.open("rb") as handle:
        head = handle.read(_SNIFF)
    if head[:4] == b"PAR1":
        return "parquet"
    if b"\x00" in head:
        return "binary"
    first = next((line for line in head.split(b"\n") if line.strip()), b"")
    looks = first.lstrip().startswith(b"{")
    record = None
    if looks:
        try:
            record = json.loads(first)
        except ValueError:
            record = None
    if isinstance(record, dict):
        if text_field in record:
            return "jsonl"
        if path.name.lower().endswith(_JSON_SUFFIXES):
            raise ConfigError(
                f"{str(path)!r} holds JSON records without the field {text_field!r} "
                f"(text_field); its first record's keys: {sorted(record)}"
            )
    return "text"


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    ]
    # Hash order mixes the modules (sorted order would read one package after another).
    files.sort(key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p.as_posix()))
    return root, files


def _folder_files(path: Path) -> list[Path]:
    out: list[Path] = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        out.extend(Path(root) / f for f in sorted(files))
    return sorted((p for p in out if p.is_file()), key=lambda p: p.relative_to(path).as_posix())


def _is_datasets_folder(path: Path) -> bool:
    """A folder ``save_to_disk`` wrote (a Dataset's ``state.json``, a DatasetDict's
    ``dataset_dict.json``)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _need_pyarrow(what: str) -> Any:
    try:
        import pyarrow
    except ModuleNotFoundError:
        raise ConfigError(
            f"{what}: install nxd-trainer[data] (the `datasets` and `pyarrow` packages) to read it"
        ) from None
    return pyarrow


def _parquet_source(path: Path, name: str, text_field: str) -> Source:
    _need_pyarrow(f"{name!r} is a Parquet file")
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(str(path)).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if text_field not in names:
        raise ConfigError(
            f"the Parquet file {name!r} has no column {text_field!r} (text_field); its "
            f"columns: {names}"
        )
    column = names.index(text_field)
    measure = sum(
        meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups)
    )
    return Source("parquet", str(path), name, meta.num_rows, measure, meta.num_rows)


def arrow_batches(path: str) -> Iterator[Any]:
    import pyarrow as pa

    with pa.memory_map(path, "r") as mapped:
        try:
            reader = pa.ipc.open_stream(mapped)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(mapped)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader


def _arrow_source(path: Path, name: str, text_field: str, split: int | None) -> Source:
    import pyarrow as pa

    rows = measure = 0
    for batch in arrow_batches(str(path)):
        if text_field not in batch.schema.names:
            raise ConfigError(
                f"{name!r} has no column {text_field!r} (text_field); its columns: "
                f"{batch.schema.names}"
            )
        kind = batch.schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(f"the column {text_field!r} of {name!r} holds {kind}, not text")
        rows += batch.num_rows
        measure += batch.column(text_field).nbytes
    return Source("arrow", str(path), name, rows, measure, rows, split=split)


def _datasets_sources(path: Path, text_field: str) -> tuple[list[Source], str]:
    _need_pyarrow(f"{str(path)!r} is a `datasets` folder")
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text())["splits"]
        train = "train" if "train" in splits else splits[0]
        valid = next((s for s in ("validation", "valid", "test") if s in splits), None)
        parts = [(path / train, TRAIN if valid else None)]
        if valid:
            parts.append((path / valid, VALID))
    else:
        parts = [(path, None)]
    sources = []
    for folder, split in parts:
        state = json.loads((folder / "state.json").read_text())
        for entry in state["_data_files"]:
            file = folder / entry["filename"]
            sources.append(
                _arrow_source(file, file.relative_to(path).as_posix(), text_field, split)
            )
    return sources, f"datasets folder {str(path)!r}"


def _load_dataset_sources(builder: str, files: str, text_field: str) -> tuple[list[Source], str]:
    import glob

    try:
        import datasets
    except ModuleNotFoundError:
        raise ConfigError(
            f"data {builder}:{files}: install the `datasets` package for datasets.load_dataset"
        ) from None
    try:  # a name that is no packaged builder would be looked up on the Hub
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES as builders
    except ImportError:  # another layout of `datasets`: let load_dataset judge
        builders = None
    if builders is not None and builder not in builders:
        raise ConfigError(
            f"data {builder}:{files}: {builder!r} is not a datasets builder for local files; "
            f"one of: {', '.join(sorted(builders))}"
        )
    matched = sorted(glob.glob(os.path.expanduser(files), recursive=True))
    if not matched:
        raise ConfigError(f"data {builder}:{files}: no file matches {files!r}")
    try:
        loaded = datasets.load_dataset(builder, data_files=matched, split="train")
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(
            f"datasets.load_dataset({builder!r}) failed on {files!r}: {error}"
        ) from None
    caches = [c["filename"] for c in loaded.cache_files]
    if not caches:
        raise ConfigError(f"datasets.load_dataset({builder!r}) kept {files!r} in memory only")
    sources = [_arrow_source(Path(c), Path(c).name, text_field, None) for c in caches]
    return sources, f"datasets.load_dataset({builder!r}) of {len(matched)} file(s) {files!r}"


def discover(cfg: TrainConfig) -> tuple[list[Source], str]:
    """The sources of ``cfg.data`` in order (nothing hashed yet, nothing capped)."""
    field_ = cfg.text_field
    if cfg.data is None:
        root, files = _stdlib_files()
        sources = [_file_source(p, p.relative_to(root).as_posix(), "text") for p in files]
        return sources, f"standard library at {root}"
    spec = data_spec(cfg.data)
    if spec is not None:
        return _load_dataset_sources(*spec, field_)
    path = Path(cfg.data).expanduser()
    if not path.exists():
        raise ConfigError(f"data path {cfg.data!r} does not exist")
    if _is_datasets_folder(path):
        return _datasets_sources(path, field_)
    if path.is_file():
        kind = _sniff(path, field_)
        if kind == "binary":
            raise ConfigError(f"data file {cfg.data!r} is not text (it holds NUL bytes)")
        return [_typed_source(path, path.name, kind, field_)], f"file {cfg.data!r}"
    sources = []
    for p in _folder_files(path):
        kind = _sniff(p, field_)
        if kind != "binary":
            sources.append(_typed_source(p, p.relative_to(path).as_posix(), kind, field_))
    return sources, f"folder {cfg.data!r}"


def _file_source(path: Path, name: str, kind: str) -> Source:
    size = path.stat().st_size
    return Source(kind, str(path), name, size, size, 1)


def _typed_source(path: Path, name: str, kind: str, text_field: str) -> Source:
    if kind == "parquet":
        return _parquet_source(path, name, text_field)
    return _file_source(path, name, kind)
