"""Validate an index before anything is read through it: the whole plan, then the load.

A native index (``index.json``) is accepted only when

* every field has its type (an index that is a list, a shape of strings, a chunk with an
  unknown field: one :class:`FormatError` naming the index and the field);
* every file name is a contained relative path (:func:`nxd_ckpt.format._contain.check_relative`);
* every tensor's dtype is one safetensors stores, and its chunks **tile** its global shape:
  each box lies inside the shape, the boxes are pairwise disjoint and their volumes add up
  to the tensor's, so every element is written by exactly one chunk;
* every chunk names a listed file, has ``crc_rows >= 1`` and exactly one CRC-32 per block of
  ``crc_rows`` rows (an emptied list is an error, not a skipped check), and the bytes the
  chunks of a file promise fit in that file's recorded size, so nothing is allocated for a
  shape no file can hold (a 2^40-element entry fails here);
* the JSON content (scheduler state, user content, optimizer hyper-parameters) uses only the
  encoded forms :mod:`nxd_ckpt.format._jsonstate` writes, nests at most ``MAX_DEPTH`` levels and
  refers only to stored tensors; aliases point at stored tensors.

The data files are checked against the index when they are opened
(:class:`nxd_ckpt.format._stread.FileReader`: size, header CRC, each chunk's stored dtype, shape and
byte range).
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from nxd_ckpt.format._contain import check_relative
from nxd_ckpt.format._jsonstate import check_encoded
from nxd_ckpt.format._records import (
    CATEGORIES,
    FORMAT_NAME,
    FORMAT_VERSION,
    ChunkRecord,
    FileRecord,
    FormatError,
    TensorRecord,
)

__all__ = ["check_tiling", "expected_crcs", "parse_index", "storable_dtypes"]


def storable_dtypes() -> dict[str, int]:
    """dtype name -> item size, for the dtypes safetensors stores."""
    from nxd_ckpt.format._stfile import _ST_DTYPES, dtype_name

    return {dtype_name(d): d.itemsize for d in _ST_DTYPES}


def _int(value: Any, where: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be >= {minimum}, got {value}")
    return value


def _ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise FormatError(f"{where} must be a list of integers, got {value!r}")
    return [_int(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{where} must be a string, got {value!r}")
    return value


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FormatError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise FormatError(f"{where} must be true or false, got {value!r}")
    return value


def _fields_of(record: dict[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(record) - known)
    if unknown:
        raise FormatError(f"{where}: unexpected field(s) {unknown}")


def _file(record: Any, where: str) -> FileRecord:
    record = _dict(record, where)
    _fields_of(record, FileRecord, where)
    values = {}
    for f in fields(FileRecord):
        if f.name in record:
            values[f.name] = _int(record[f.name], f"{where}.{f.name}")
        elif f.name in ("size", "crc32", "header_crc32", "rank"):
            raise FormatError(f"{where}: missing field {f.name!r}")
    return FileRecord(**values)


def _chunk(record: Any, where: str) -> ChunkRecord:
    record = _dict(record, where)
    _fields_of(record, ChunkRecord, where)
    for name in ("file", "key", "offsets", "shape", "crc32", "crc_rows"):
        if name not in record:
            raise FormatError(f"{where}: missing field {name!r}")
    stored = record.get("stored_offsets")
    return ChunkRecord(
        file=_str(record["file"], f"{where}.file"),
        key=_str(record["key"], f"{where}.key"),
        offsets=_ints(record["offsets"], f"{where}.offsets"),
        shape=_ints(record["shape"], f"{where}.shape"),
        crc32=_ints(record["crc32"], f"{where}.crc32"),
        crc_rows=_int(record["crc_rows"], f"{where}.crc_rows", 1),
        tp_rank=_int(record.get("tp_rank", 0), f"{where}.tp_rank"),
        pp_rank=_int(record.get("pp_rank", 0), f"{where}.pp_rank"),
        dp_rank=_int(record.get("dp_rank", 0), f"{where}.dp_rank"),
        stored_offsets=None if stored is None else _ints(stored, f"{where}.stored_offsets"),
    )


def _tensor(record: Any, where: str) -> TensorRecord:
    record = _dict(record, where)
    _fields_of(record, TensorRecord, where)
    for name in ("shape", "dtype"):
        if name not in record:
            raise FormatError(f"{where}: missing field {name!r}")
    chunks = record.get("chunks", [])
    if not isinstance(chunks, list):
        raise FormatError(f"{where}.chunks must be a list")
    return TensorRecord(
        shape=_ints(record["shape"], f"{where}.shape"),
        dtype=_str(record["dtype"], f"{where}.dtype"),
        chunks=[_chunk(c, f"{where}.chunks[{i}]") for i, c in enumerate(chunks)],
        sharding=_dict(record.get("sharding", {}), f"{where}.sharding"),
    )


def expected_crcs(shape: list[int], crc_rows: int) -> int:
    """How many CRC-32s a stored chunk of ``shape`` carries (the writer's block rule)."""
    if not shape:
        return 1
    if math.prod(shape) == 0:
        return 0
    return -(-shape[0] // crc_rows)


def check_tiling(shape: list[int], boxes: list[tuple[list[int], list[int]]], where: str) -> None:
    """The boxes ``(offsets, shape)`` lie inside ``shape``, are pairwise disjoint and cover
    it: every element exactly once. A sweep along the dimension with the most distinct
    starts compares each box only with the boxes it may meet there."""
    total = math.prod(shape)
    volume = 0
    nonempty = []
    for number, (offsets, size) in enumerate(boxes):
        if len(offsets) != len(shape) or len(size) != len(shape):
            raise FormatError(
                f"{where}: chunk {number} has offsets {offsets} and shape {size}, but the "
                f"tensor has {len(shape)} dimension(s)"
            )
        for o, s, full in zip(offsets, size, shape):
            if o + s > full:
                raise FormatError(
                    f"{where}: chunk {number} (offsets {offsets}, shape {size}) lies outside "
                    f"the tensor's shape {shape}"
                )
        count = math.prod(size)
        volume += count
        if count:
            nonempty.append((number, offsets, size))
    if volume != total:
        raise FormatError(
            f"{where}: its chunks hold {volume} elements but the tensor has {total}: the "
            f"chunks do not tile it (missing or overlapping pieces)"
        )
    if len(nonempty) < 2:
        return
    dim = max(range(len(shape)), key=lambda d: len({b[1][d] for b in nonempty}))
    ordered = sorted(nonempty, key=lambda b: b[1][dim])
    active: list[tuple[int, list[int], list[int]]] = []
    for box in ordered:
        start = box[1][dim]
        active = [a for a in active if a[1][dim] + a[2][dim] > start]
        for other in active:
            if all(
                max(a, b) < min(a + s, b + t)
                for a, s, b, t in zip(box[1], box[2], other[1], other[2])
            ):
                raise FormatError(
                    f"{where}: chunks {other[0]} (offsets {other[1]}, shape {other[2]}) and "
                    f"{box[0]} (offsets {box[1]}, shape {box[2]}) overlap: the chunks do not "
                    f"tile the tensor"
                )
        active.append(box)


def _check_scalars(value: Any, where: str) -> None:
    dtypes = storable_dtypes()
    for name, entries in _dict(value, where).items():
        for key, entry in _dict(entries, f"{where}.{name}").items():
            entry = _dict(entry, f"{where}.{name}.{key}")
            unknown = sorted(set(entry) - {"value", "dtype", "shape"})
            if unknown or "value" not in entry:
                raise FormatError(f"{where}.{name}.{key}: expected value/dtype/shape, got {entry}")
            scalar = entry["value"]
            if scalar is not None and not isinstance(scalar, (bool, int, float)):
                raise FormatError(f"{where}.{name}.{key}.value must be a number, got {scalar!r}")
            if "dtype" in entry and entry["dtype"] not in dtypes:
                raise FormatError(f"{where}.{name}.{key}: unknown dtype {entry['dtype']!r}")
            if "shape" in entry and math.prod(_ints(entry["shape"], f"{where}.{name}.{key}")) != 1:
                raise FormatError(f"{where}.{name}.{key}: a scalar's shape must hold 1 element")


def _check_optimizer(meta: Any, where: str) -> None:
    meta = _dict(meta, where)
    groups = meta.get("param_groups")
    if not isinstance(groups, list):
        raise FormatError(f"{where}.param_groups must be a list")
    for index, group in enumerate(groups):
        here = f"{where}.param_groups[{index}]"
        group = _dict(group, here)
        if "hyper" not in group or not isinstance(group.get("params"), list):
            raise FormatError(f"{here} must hold 'hyper' and a 'params' list")
        for name in group["params"]:
            _str(name, f"{here}.params[]")
        check_encoded(group["hyper"], set(), f"{here}.hyper")
    _check_scalars(meta.get("scalars", {}), f"{where}.scalars")
    for flag in ("zero1", "master_weights", "by_position"):
        if flag in meta:
            _bool(meta[flag], f"{where}.{flag}")
    if "class" in meta:
        _str(meta["class"], f"{where}.class")


def _check_tensor(
    category: str,
    name: str,
    record: TensorRecord,
    files: dict[str, FileRecord],
    promised: dict[str, int],
    source: str,
) -> None:
    where = f"{source}: {category} tensor {name!r}"
    dtypes = storable_dtypes()
    itemsize = dtypes.get(record.dtype)
    if itemsize is None:
        raise FormatError(f"{where}: unknown dtype {record.dtype!r} (stored: {sorted(dtypes)})")
    for number, chunk in enumerate(record.chunks):
        here = f"{where}, chunk {number}"
        if chunk.file not in files:
            raise FormatError(f"{here}: names file {chunk.file!r}, which the index does not list")
        nbytes = math.prod(chunk.shape) * itemsize
        if nbytes > files[chunk.file].size:
            raise FormatError(
                f"{here} (shape {chunk.shape}): holds {nbytes} bytes, more than its file "
                f"{chunk.file} has ({files[chunk.file].size} bytes)"
            )
        if chunk.stored_offsets is not None:
            raise FormatError(f"{here}: stored_offsets are for foreign layouts only")
        expected = expected_crcs(chunk.shape, chunk.crc_rows)
        if len(chunk.crc32) != expected:
            raise FormatError(
                f"{here} (file {chunk.file}, key {chunk.key!r}): {len(chunk.crc32)} CRC-32s for "
                f"{expected} block(s) of {chunk.crc_rows} rows: every block must have its CRC"
            )
        if any(crc >= 1 << 32 for crc in chunk.crc32):
            raise FormatError(f"{here}: a CRC-32 is out of range")
        promised[chunk.file] = promised.get(chunk.file, 0) + nbytes
    check_tiling(record.shape, [(c.offsets, c.shape) for c in record.chunks], where)


def parse_index(cls: type, data: Any, source: str) -> Any:
    """The :class:`~nxd_ckpt.format.CheckpointIndex` of a native ``index.json`` document,
    validated as the module docstring says."""
    _check_header(data, cls, source)
    files = {
        str(check_relative(path, source)): _file(record, f"{source}: files[{path!r}]")
        for path, record in _dict(data.get("files", {}), f"{source}: files").items()
    }
    tensors = _tensors(data, files, source)
    aliases = _aliases(data, tensors, source)
    _check_non_tensor_fields(data, tensors, source)
    values = dict(data)
    values.update(files=files, tensors=tensors, aliases=aliases)
    return cls(**values)


def _check_header(data: Any, cls: type, source: str) -> None:
    """An nxd-ckpt index of this format version, with only known fields and the required ones."""
    if not isinstance(data, dict):
        raise FormatError(
            f"{source}: the index is a JSON {type(data).__name__}, not an object: not an "
            f"nxd-ckpt index"
        )
    if data.get("format") != FORMAT_NAME:
        raise FormatError(f"{source}: format {data.get('format')!r} is not {FORMAT_NAME!r}")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{source}: format_version {version!r} is not supported: this nxd-ckpt reads "
            f"version {FORMAT_VERSION} (a newer nxd-ckpt wrote it? upgrade nxd-ckpt)"
        )
    _fields_of(data, cls, source)
    for name in ("tag", "save_id", "parallel"):
        if name not in data:
            raise FormatError(f"{source}: missing field {name!r}")


def _tensors(
    data: dict[str, Any], files: dict[str, FileRecord], source: str
) -> dict[str, dict[str, TensorRecord]]:
    """Every category's tensor records, each tiling its tensor within the files' sizes."""
    tensors: dict[str, dict[str, TensorRecord]] = {}
    for category, records in _dict(data.get("tensors", {}), f"{source}: tensors").items():
        if category not in CATEGORIES:
            raise FormatError(f"{source}: unknown tensor category {category!r}")
        tensors[category] = {
            name: _tensor(record, f"{source}: {category} tensor {name!r}")
            for name, record in _dict(records, f"{source}: tensors.{category}").items()
        }
    promised: dict[str, int] = {}
    for category, records in tensors.items():
        for name, record in records.items():
            _check_tensor(category, name, record, files, promised, source)
    for path, nbytes in promised.items():
        if nbytes > files[path].size:
            raise FormatError(
                f"{source}: its chunks promise {nbytes} bytes in {path}, which the index "
                f"records as {files[path].size} bytes"
            )
    return tensors


def _aliases(
    data: dict[str, Any], tensors: dict[str, dict[str, TensorRecord]], source: str
) -> dict[str, dict[str, str]]:
    """Category -> alias -> a stored tensor's name."""
    aliases: dict[str, dict[str, str]] = {}
    for category, entries in _dict(data.get("aliases", {}), f"{source}: aliases").items():
        aliases[category] = {}
        for alias, target in _dict(entries, f"{source}: aliases.{category}").items():
            if target not in tensors.get(category, {}):
                raise FormatError(
                    f"{source}: alias {alias!r} of {category} names {target!r}, which is not stored"
                )
            aliases[category][alias] = target
    return aliases


def _check_non_tensor_fields(
    data: dict[str, Any], tensors: dict[str, dict[str, TensorRecord]], source: str
) -> None:
    """The fields that are not tensors: their types, and the JSON content's tensor references."""
    _dict(data["parallel"], f"{source}: parallel")
    _str(data["tag"], f"{source}: tag")
    _str(data["save_id"], f"{source}: save_id")
    for flag in ("has_scheduler", "has_user_content"):
        if flag in data:
            _bool(data[flag], f"{source}: {flag}")
    for key in ("lora", "hf_config"):
        if data.get(key) is not None:
            _dict(data[key], f"{source}: {key}")
    if data.get("scheduler_class") is not None:
        _str(data["scheduler_class"], f"{source}: scheduler_class")
    if data.get("optimizer") is not None:
        _check_optimizer(data["optimizer"], f"{source}: optimizer")
    for category in ("scheduler", "user_content"):
        stored = set(tensors.get(category, {}))
        check_encoded(data.get(category), stored, f"{source}: {category}")
