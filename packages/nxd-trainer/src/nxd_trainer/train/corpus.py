"""The corpus of an ``nxd-train`` run as a plan of tasks: what is read, in which order, which
part is validation, all decided by content, without holding the corpus in memory.

**Inputs**: :mod:`nxd_trainer.train.inputs` (files and folders recognised by content, JSON
Lines, Parquet, ``datasets`` folders and ``load_dataset``, the standard library by default).

**Documents**: a text file, a JSON line, a Parquet or Arrow row. A document is cut into pieces of
about ``PIECE`` = 64 KiB at line ends (byte offsets ``cut(j·PIECE)``: just after the first
newline at or after ``j·PIECE - 1``, or at ``j·PIECE`` (a UTF-8 boundary) when no newline comes
within ``PIECE``), the unit that is encoded and, with few documents, split.

**Split** (``f`` = ``val_fraction``; ``held(h)``: ``h mod 10_000 < round(f · 10_000)``), with
``D`` documents and ``P`` pieces:

* ``given``: a ``DatasetDict`` with a validation split keeps it;
* ``documents`` (``f · D >= 32``): a document is validation when ``held(crc32(its bytes))``;
* ``pieces`` (``f · P >= 32``, few documents): a piece is validation when
  ``held(crc32(its bytes))``: the split runs inside files;
* ``tail`` (a small corpus): the corpus' last ``f`` (of bytes; a Parquet/Arrow row weighs its
  text's bytes), from the nearest document boundary within ``f/2`` of the cut point, else
  (inside a text) from the start of the line holding it.

With 32 expected held-out units the chance of an empty split is e^-32. Every maximal run of
one document's consecutive pieces in one split is a document of that split (it ends with EOS).

**Tasks**: the sources in order (sorted paths; the standard library in crc32 order of its paths,
so that modules mix), cut into segments at ``cut(k · TASK)`` (text, JSON Lines: 1 MiB) or row
groups / record batches (Parquet, Arrow), grouped into tasks of about ``TASK`` bytes: the unit of
parallel work and of resumption. ``corpus_mb`` > 0 keeps the first ``corpus_mb`` MB (the source
that crosses it is cut at a line end or a row).

The plan's ``key`` hashes (BLAKE2b) the bytes used of every source, in order, with the split
settings: two paths to the same content share it; names do not enter it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from nxd_trainer.train.config import ConfigError, TrainConfig
from nxd_trainer.train.inputs import TRAIN, VALID, Source, arrow_batches, discover

__all__ = [
    "PIECE",
    "TASK",
    "TRAIN",
    "VALID",
    "Corpus",
    "Plan",
    "Segment",
    "Task",
    "iter_units",
    "load_corpus",
    "plan_corpus",
]

PIECE = 1 << 16  # documents are encoded (and, when few, split) in pieces of ~64 KiB
TASK = 1 << 20  # parallel work and resumption: ~1 MiB of input per task
FORMAT = 1  # of the plan (a change re-keys every cache)
MIN_HELD = 32  # expected held-out units for a hash split (else the next coarser rule)
_READ = 1 << 20


@dataclass(frozen=True)
class Segment:
    """``[start, end)`` of source ``source`` (bytes, or rows for Parquet/Arrow); ``split``
    when forced (tail, given), else by hash; ``then``: the forced split of what follows in
    the same document (None: the document ends here, or hashing decides)."""

    source: int
    start: int
    end: int
    split: int | None = None
    then: int | None = None


@dataclass(frozen=True)
class Task:
    index: int
    segments: tuple[Segment, ...]
    measure: int


@dataclass
class Plan:
    """Everything needed to read the corpus in tasks (picklable: sent to the workers)."""

    sources: list[Source]
    tasks: list[Task]
    mode: str
    fraction: float
    text_field: str
    description: str
    key: str
    documents: int
    measure: int
    notes: list[str] = field(default_factory=list)


def held(h: int, fraction: float) -> bool:
    """Whether a unit whose hash is ``h`` goes to validation."""
    return h % 10_000 < round(fraction * 10_000)


# --- cutting ---------------------------------------------------------------------------------
def cut_bytes(data: bytes | memoryview, x: int, start: int, end: int) -> int:
    """The cut of grid point ``x`` in ``data[start:end]`` (see the module docstring)."""
    if x <= start:
        return start
    if x >= end:
        return end
    i = bytes(data[x - 1 : min(end, x - 1 + PIECE)]).find(b"\n")
    if i >= 0:
        return x + i
    while x < end and (data[x] & 0xC0) == 0x80:  # a UTF-8 continuation byte
        x += 1
    return x


def cut_file(handle: Any, x: int, start: int, end: int) -> int:
    """:func:`cut_bytes` on an open binary file (reads one window)."""
    if x <= start or x >= end:
        return min(max(x, start), end)
    handle.seek(x - 1)
    window = handle.read(min(end, x - 1 + PIECE + 4) - (x - 1))
    i = window[:PIECE].find(b"\n")
    if i >= 0:
        return min(x + i, end)
    j = 1
    while j < len(window) and x + j - 1 < end and (window[j] & 0xC0) == 0x80:
        j += 1
    return min(x + j - 1, end)


def line_start_at_or_after(handle: Any, x: int, end: int) -> int:
    """The first line start at or after ``x`` (records: never inside a line); ``end`` if none."""
    if x <= 0:
        return 0
    pos = x - 1
    handle.seek(pos)
    while pos < end:
        chunk = handle.read(min(_READ, end - pos))
        if not chunk:
            break
        i = chunk.find(b"\n")
        if i >= 0:
            return min(pos + i + 1, end)
        pos += len(chunk)
    return end


def pieces_of(data: bytes, offset: int = 0) -> list[bytes]:
    """``data`` (starting at absolute offset ``offset``, itself a cut) cut at the grid."""
    out = []
    start, end = 0, len(data)
    j = offset // PIECE + 1
    while start < end:
        nxt = cut_bytes(data, j * PIECE - offset, start, end) if j * PIECE - offset < end else end
        j += 1
        if nxt > start:
            out.append(data[start:nxt])
            start = nxt
    return out


def pieces_of_text(text: str) -> list[str]:
    """A record's text cut at the grid, in characters (after the first newline at or after
    ``j·PIECE - 1``, or at ``j·PIECE``)."""
    if len(text) <= PIECE:
        return [text]
    out, start, j = [], 0, 1
    while start < len(text):
        x = j * PIECE
        j += 1
        if x >= len(text):
            nxt = len(text)
        else:
            i = text.find("\n", x - 1, x - 1 + PIECE)
            nxt = i + 1 if i >= 0 else x
        if nxt > start:
            out.append(text[start:nxt])
            start = nxt
    return out


# --- the cap, the hashes ---------------------------------------------------------------------
def _cap(sources: list[Source], budget: int) -> list[Source]:
    """The sources up to ``budget`` bytes of measure (0: all); the one crossing it is cut."""
    if not budget:
        return sources
    out, total = [], 0
    for source in sources:
        if total >= budget:
            break
        left = budget - total
        if source.measure <= left:
            out.append(source)
            total += source.measure
            continue
        if source.kind in ("text", "jsonl"):
            with open(source.path, "rb") as handle:
                used = (
                    cut_file(handle, left, 0, source.used)
                    if source.kind == "text"
                    else line_start_at_or_after(handle, left, source.used)
                )
            used = max(used, 1)
            out.append(replace(source, used=used, measure=used))
        else:
            rows = max(1, -(-source.rows * left // source.measure))
            out.append(replace(source, used=rows, rows=rows, measure=left))
        break
    return out


def _hash_source(source: Source) -> Source:
    """The BLAKE2b digest (and crc32, line count) of what is used of ``source``."""
    digest = hashlib.blake2b(digest_size=20)
    crc = 0
    lines = 0
    blank = source.kind == "text"  # a text of whitespace only is no document
    limit = source.used if source.kind in ("text", "jsonl") else None
    done = 0
    with open(source.path, "rb") as handle:
        while limit is None or done < limit:
            chunk = handle.read(_READ if limit is None else min(_READ, limit - done))
            if not chunk:
                break
            digest.update(chunk)
            if source.kind == "text":
                crc = zlib.crc32(chunk, crc)
                blank = blank and not chunk.strip()
            elif source.kind == "jsonl":
                lines += chunk.count(b"\n")
            done += len(chunk)
    if source.kind == "parquet" or source.kind == "arrow":
        digest.update(f"rows {source.used}".encode())
    if source.kind == "jsonl":
        return replace(source, digest=digest.hexdigest(), rows=max(1, lines))
    return replace(source, digest=digest.hexdigest(), crc=crc, rows=0 if blank else 1)


# --- the plan --------------------------------------------------------------------------------
def plan_corpus(cfg: TrainConfig, threads: int | None = None) -> Plan:
    """The corpus of ``cfg`` as a plan (reads every used byte once, to hash it)."""
    found, description = discover(cfg)
    sources = _cap(found, int(cfg.corpus_mb * 1e6))
    if not sources:
        raise ConfigError(f"the corpus {description} has no text")
    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
        sources = [s for s in pool.map(_hash_source, sources) if s.rows]
    if not sources:
        raise ConfigError(f"the corpus {description} has no text")
    measure = sum(s.measure for s in sources)
    documents = sum(s.rows for s in sources)
    if measure == 0:
        raise ConfigError(f"the corpus {description} has no text")
    f = cfg.val_fraction
    pieces = sum(max(1, -(-s.measure // PIECE)) for s in sources)
    notes = []
    if any(s.split is not None for s in sources):
        mode = "given"
    elif f * documents >= MIN_HELD:
        mode = "documents"
    elif f * pieces >= MIN_HELD:
        mode = "pieces"
        notes.append(f"{documents} document(s): the validation split runs inside them")
    else:
        mode = "tail"
        notes.append(f"a small corpus: its last {100 * f:.0f}% is the validation split")
    tasks = _tasks(sources, mode, f, description)
    key_fields = {
        "format": FORMAT,
        "mode": mode,
        "fraction": f,
        "field": cfg.text_field if any(s.kind != "text" for s in sources) else None,
        "sources": [[s.kind, s.digest, s.used, s.split] for s in sources],
    }
    key = hashlib.blake2b(json.dumps(key_fields).encode(), digest_size=16).hexdigest()
    return Plan(sources, tasks, mode, f, cfg.text_field, description, key, documents, measure,
                notes)  # fmt: skip


def _tail_cut(sources: list[Source], fraction: float, description: str) -> tuple[int, int]:
    """(source index, position) where validation starts in tail mode: at ``c = (1 - f) · M``
    of the corpus' measure ``M``, moved to the nearest document boundary within ``f/2 · M``,
    else (a text) to the start of the line holding it."""
    total = sum(s.measure for s in sources)
    point = (1 - fraction) * total
    seen = 0
    for i, source in enumerate(sources):
        if point < seen + source.measure or i == len(sources) - 1:
            break
        seen += source.measure
    candidates: list[tuple[float, int, int]] = []  # (distance, source, position)
    if i > 0:
        candidates.append((point - seen, i, 0))
    if i + 1 < len(sources):
        candidates.append((seen + source.measure - point, i + 1, 0))
    inside = (point - seen) / source.measure if source.measure else 0.0
    if source.kind == "jsonl":
        x = int(inside * source.used)
        with open(source.path, "rb") as handle:
            for pos in (
                _line_start_before(handle, x),
                line_start_at_or_after(handle, x, source.used),
            ):
                if 0 < pos < source.used or (pos == 0 and i > 0):
                    candidates.append((abs(pos - inside * source.used), i, pos))
    elif source.kind in ("parquet", "arrow"):
        row = round(inside * source.used)
        if 0 < row < source.used:
            per_row = source.measure / source.used
            candidates.append((abs(row - inside * source.used) * per_row, i, row))
    near = [c for c in candidates if c[0] <= fraction / 2 * total]
    if near or (candidates and source.kind != "text"):
        _, at, pos = min(near or candidates)
        return at, pos
    if source.kind != "text":
        raise ConfigError(f"the corpus {description} has one document: give more text")
    x = min(max(1, int(inside * source.used)), source.used - 1)
    with open(source.path, "rb") as handle:
        pos = _line_start_before(handle, x)
        if pos < 0:  # a line longer than a piece: cut inside it
            pos = _utf8_boundary(handle, x, source.used)
        if pos == 0 and i == 0:  # that line starts the corpus: the next one, else inside it
            pos = line_start_at_or_after(handle, x + 1, source.used)
            if pos >= source.used:
                pos = _utf8_boundary(handle, x, source.used)
    return i, pos


def _line_start_before(handle: Any, x: int) -> int:
    """The start of the line holding byte ``x`` (-1: none within a piece before it)."""
    low = max(0, x - PIECE)
    handle.seek(low)
    j = handle.read(x - low).rfind(b"\n")
    return low + j + 1 if j >= 0 or low == 0 else -1


def _utf8_boundary(handle: Any, x: int, end: int) -> int:
    """The first offset at or after ``x`` that starts a UTF-8 character."""
    handle.seek(x)
    ahead = handle.read(4)
    j = 0
    while j < len(ahead) and x + j < end and (ahead[j] & 0xC0) == 0x80:
        j += 1
    return x + j


def _grid(source: Source, start: int, end: int) -> list[int]:
    """The segment bounds of ``[start, end)`` of a text/JSON Lines source: cuts at the TASK
    grid."""
    bounds = [start]
    with open(source.path, "rb") as handle:
        k = start // TASK + 1
        while k * TASK < end:
            if source.kind == "text":
                c = cut_file(handle, k * TASK, 0, source.used)
            else:
                c = line_start_at_or_after(handle, k * TASK, source.used)
            if bounds[-1] < c < end:
                bounds.append(c)
            k += 1
    bounds.append(end)
    return bounds


def _row_grid(source: Source, start: int, end: int) -> list[int]:
    """Row bounds of ``[start, end)``: Parquet row groups, or ~TASK bytes of Arrow rows."""
    bounds = [start]
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(source.path).metadata
        row = 0
        for g in range(meta.num_row_groups):
            row += meta.row_group(g).num_rows
            if start < row < end:
                bounds.append(row)
    else:
        per_row = max(1.0, source.measure / max(1, source.used))
        step = max(1, int(TASK / per_row))
        bounds.extend(r for r in range((start // step + 1) * step, end, step))
    bounds.append(end)
    return bounds


def _tasks(sources: list[Source], mode: str, fraction: float, description: str) -> list[Task]:
    regions: list[list[tuple[int, int, int | None]]] = []
    for source in sources:
        forced = source.split if mode == "given" else None
        regions.append([(0, source.used, forced)])
    if mode == "tail":
        at, pos = _tail_cut(sources, fraction, description)
        for i in range(len(sources)):
            if i < at:
                regions[i] = [(0, sources[i].used, TRAIN)]
            elif i > at:
                regions[i] = [(0, sources[i].used, VALID)]
            else:
                parts = [(0, pos, TRAIN), (pos, sources[i].used, VALID)]
                regions[i] = [r for r in parts if r[1] > r[0]]
    segments: list[tuple[Segment, int]] = []
    for i, source in enumerate(sources):
        for r, (start, end, forced) in enumerate(regions[i]):
            records = source.kind in ("parquet", "arrow")
            bounds = _row_grid(source, start, end) if records else _grid(source, start, end)
            for a, b in itertools.pairwise(bounds):
                then = None
                if b < source.used and forced is not None and source.kind == "text":
                    then = forced if b < end else regions[i][r + 1][2]
                weight = b - a if not records else int(source.measure * (b - a) / source.used)
                segments.append((Segment(i, a, b, forced, then), weight))
    tasks: list[Task] = []
    group: list[Segment] = []
    weight = 0
    for segment, w in segments:
        group.append(segment)
        weight += w
        if weight >= TASK:
            tasks.append(Task(len(tasks), tuple(group), weight))
            group, weight = [], 0
    if group:
        tasks.append(Task(len(tasks), tuple(group), weight))
    return tasks


# --- reading a task ----------------------------------------------------------------------------
def _runs(
    pieces: list[tuple[Any, int]], then: int | None, last: bool
) -> Iterator[tuple[int, Any, bool]]:
    """(split, piece, ends a document of its split) for one document's consecutive pieces;
    ``then`` is the split of the piece after them (None: the document ends with them)."""
    for n, (piece, split) in enumerate(pieces):
        ends = pieces[n + 1][1] != split if n + 1 < len(pieces) else last or then != split
        yield split, piece, ends


def _record_units(
    text: str, key: bytes, plan: Plan, forced: int | None
) -> Iterator[tuple[int, str, bool]]:
    if not text.strip():
        return
    pieces = pieces_of_text(text)
    if forced is not None:
        labelled = [(p, forced) for p in pieces]
    elif plan.mode == "documents":
        split = VALID if held(zlib.crc32(key), plan.fraction) else TRAIN
        labelled = [(p, split) for p in pieces]
    else:
        labelled = [
            (p, VALID if held(zlib.crc32(p.encode("utf-8")), plan.fraction) else TRAIN)
            for p in pieces
        ]
    yield from _runs(labelled, None, True)


def _text_units(plan: Plan, seg: Segment) -> Iterator[tuple[int, str, bool]]:
    source = plan.sources[seg.source]
    with open(source.path, "rb") as handle:
        handle.seek(seg.start)
        data = handle.read(seg.end - seg.start)
        pieces = pieces_of(data, seg.start)
        last = seg.end >= source.used
        if seg.split is not None:
            labelled = [(p, seg.split) for p in pieces]
            then = seg.then
        elif plan.mode == "documents":
            split = VALID if held(source.crc, plan.fraction) else TRAIN
            labelled = [(p, split) for p in pieces]
            then = split
        else:
            labelled = [(p, VALID if held(zlib.crc32(p), plan.fraction) else TRAIN) for p in pieces]
            then = None
            if not last:  # the next piece of the document (it starts the next segment)
                handle.seek(seg.end)
                ahead = handle.read(min(3 * PIECE, source.used - seg.end))
                nxt = pieces_of(ahead, seg.end)[0] if ahead else b""
                then = VALID if held(zlib.crc32(nxt), plan.fraction) else TRAIN
    for split, piece, ends in _runs(labelled, then, last):
        yield split, piece.decode("utf-8", errors="replace"), ends


def _jsonl_units(plan: Plan, seg: Segment) -> Iterator[tuple[int, str, bool]]:
    source = plan.sources[seg.source]
    with open(source.path, "rb") as handle:
        handle.seek(seg.start)
        data = handle.read(seg.end - seg.start)
    line_no = None
    for offset, line in _lines(data):
        raw = line.rstrip(b"\r\n \t")
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as error:
            line_no = seg.start + offset
            raise ConfigError(
                f"{source.name!r}: the record at byte {line_no} is not JSON ({error})"
            ) from None
        text = record.get(plan.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(
                f"{source.name!r}: the record at byte {seg.start + offset} has no text in "
                f"{plan.text_field!r} (text_field): {raw[:80]!s}"
            )
        yield from _record_units(text, raw, plan, seg.split)


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end + 1
        yield start, data[start:end]
        start = end


def _column_texts(plan: Plan, seg: Segment) -> Iterator[Any]:
    """The ``text_field`` values of rows ``[start, end)`` of a Parquet/Arrow source."""
    source = plan.sources[seg.source]
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(source.path)
        row = 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if row + n > seg.start and row < seg.end:
                table = pf.read_row_group(g, columns=[plan.text_field])
                lo, hi = max(seg.start - row, 0), min(seg.end - row, n)
                yield from table.column(0).slice(lo, hi - lo).to_pylist()
            row += n
            if row >= seg.end:
                return
        return
    row = 0
    for batch in arrow_batches(source.path):
        n = batch.num_rows
        if row + n > seg.start and row < seg.end:
            lo, hi = max(seg.start - row, 0), min(seg.end - row, n)
            yield from batch.column(plan.text_field).slice(lo, hi - lo).to_pylist()
        row += n
        if row >= seg.end:
            return


def _row_units(plan: Plan, seg: Segment) -> Iterator[tuple[int, str, bool]]:
    source = plan.sources[seg.source]
    for i, text in enumerate(_column_texts(plan, seg)):
        if text is None:
            raise ConfigError(
                f"{source.name!r}: row {seg.start + i} has no text in {plan.text_field!r} (null)"
            )
        yield from _record_units(text, text.encode("utf-8"), plan, seg.split)


def iter_units(plan: Plan, task: Task) -> Iterator[tuple[int, str, bool]]:
    """The task's text as ``(split, piece, ends_document)``, in order."""
    for seg in task.segments:
        kind = plan.sources[seg.source].kind
        if kind == "text":
            yield from _text_units(plan, seg)
        elif kind == "jsonl":
            yield from _jsonl_units(plan, seg)
        else:
            yield from _row_units(plan, seg)


# --- the whole corpus in memory (small corpora, tests) --------------------------------------
@dataclass
class Corpus:
    """Documents of the training and validation splits, and where they came from."""

    train: list[str]
    valid: list[str]
    source: str


def load_corpus(cfg: TrainConfig) -> Corpus:
    """Every document of ``cfg``'s corpus and split as strings (for small corpora and tests:
    the training path never holds the corpus)."""
    plan = plan_corpus(cfg)
    docs: list[list[str]] = [[], []]
    open_: list[list[str]] = [[], []]
    for task in plan.tasks:
        for split, text, ends in iter_units(plan, task):
            open_[split].append(text)
            if ends:
                docs[split].append("".join(open_[split]))
                open_[split] = []
    return Corpus(docs[TRAIN], docs[VALID], plan.description)
