"""Token shards: a corpus tokenized once, in parallel, into memory-mapped arrays of token ids.

A folder per (corpus content, tokenizer) under the cache (``<runs_dir>/.cache/tokens/<key>/``,
or ``$NXD_TRAIN_CACHE/tokens/<key>/``)::

    train.bin  valid.bin      token ids, little-endian uint16 (vocabulary <= 65536) or uint32
    train.idx  valid.idx      uint64: the end (exclusive, in tokens) of each document
    tokenizer.json            the tokenizer that made them (Hugging Face ``tokenizers``)
    meta.json                 dtype, counts, the plan's description and split mode

Each document of a split is its ids followed by EOS. The folder is written as
``<key>.partial/`` and renamed when complete (``meta.json`` inside it first), so a folder named
by its key is always whole.

**Writing** (:func:`build_shards`): the plan's tasks (about 1 MiB of input each) are tokenized by
a pool of worker processes (the tokenizer's own threads off in each), at most two
tasks per worker in flight; their ids come back in task order and are appended to the four
files. After each task, ``progress.json`` records the tasks done and the files' lengths, so an
interrupted preparation (Ctrl-C, a kill, a lost node) resumes at the next task: the files are
cut back to the recorded lengths (whatever a killed process appended after them goes) and the
result is the same bytes as an uninterrupted run. Memory: the main process holds one task's ids
per task in flight, a worker one task's text and ids.

**Reading** (:class:`TokenShards`, :class:`Blocks`): block ``i`` of ``seq_len`` is tokens
``[i·L, (i+1)·L)`` of a split, read on demand with ``pread`` (one call per row, no read-ahead):
a rank holds the rows it asked for and nothing else of the corpus, not even mapped pages
(``TokenShards.tokens`` maps a whole split, for tools).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nxd_trainer.train.config import ConfigError
from nxd_trainer.train.corpus import Plan, Task, iter_units

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor

__all__ = ["SPLITS", "Blocks", "TokenFile", "TokenShards", "build_shards", "shard_dtype"]

SPLITS = ("train", "valid")
FORMAT = 1
_PER_WORKER = 2  # tasks in flight per worker: bounds the ids held by the main process


def shard_dtype(vocab: int) -> np.dtype:
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


# --- the worker side ---------------------------------------------------------------------------
_STATE: dict[str, Any] = {}


def _init_worker(plan: Plan, tokenizer_json: str, eos: int, dtype: str) -> None:
    """A pool worker: Ctrl-C is the main process's to handle (it terminates the pool); the
    tokenizer runs on this process's one core."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _setup(plan, tokenizer_json, eos, dtype)


def _setup(plan: Plan, tokenizer_json: str, eos: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _STATE.update(
        plan=plan, tokenizer=Tokenizer.from_str(tokenizer_json), eos=eos, dtype=np.dtype(dtype)
    )


def tokenize_task(task: Task) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One task's ``[train ids, valid ids]`` and ``[train ends, valid ends]`` (document ends,
    relative to the task's first id of that split)."""
    plan, tokenizer = _STATE["plan"], _STATE["tokenizer"]
    eos, dtype = _STATE["eos"], _STATE["dtype"]
    units = list(iter_units(plan, task))
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encoded = encode([text for _, text, _ in units], add_special_tokens=False)
    parts: list[list[np.ndarray]] = [[], []]
    ends: list[list[int]] = [[], []]
    count = [0, 0]
    eos_array = np.array([eos], dtype=dtype)
    for (split, _, closes), enc in zip(units, encoded):
        ids = enc.ids
        if ids:
            parts[split].append(np.asarray(ids, dtype=dtype))
            count[split] += len(ids)
        if closes:
            parts[split].append(eos_array)
            count[split] += 1
            ends[split].append(count[split])
    ids_out = [np.concatenate(p) if p else np.empty(0, dtype) for p in parts]
    return ids_out, [np.asarray(e, dtype=np.uint64) for e in ends]


# --- the main side -----------------------------------------------------------------------------
@dataclass
class _Files:
    """The four files of a folder being written, and their committed lengths."""

    root: Path
    itemsize: int

    def open(self, lengths: dict[str, list[int]]) -> None:
        self.handles = {}
        for split in SPLITS:
            for suffix, size in (("bin", self.itemsize), ("idx", 8)):
                path = self.root / f"{split}.{suffix}"
                path.touch()
                with path.open("r+b") as handle:  # drop what was appended after the record
                    handle.truncate(lengths[split][0 if suffix == "bin" else 1] * size)
                self.handles[split, suffix] = path.open("ab")

    def append(self, split: str, ids: np.ndarray, ends: np.ndarray) -> None:
        self.handles[split, "bin"].write(ids.tobytes())
        self.handles[split, "idx"].write(ends.astype("<u8").tobytes())

    def flush(self, sync: bool = False) -> None:
        for handle in self.handles.values():
            handle.flush()
            if sync:
                os.fsync(handle.fileno())

    def close(self) -> None:
        for handle in getattr(self, "handles", {}).values():
            handle.close()


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def workers_default() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def build_shards(
    plan: Plan,
    tokenizer_json: str,
    eos: int,
    vocab: int,
    folder: Path,
    *,
    workers: int | None = None,
    progress: bool = True,
    on_task: Callable[[int], None] | None = None,
) -> Path:
    """Tokenize ``plan`` into the shards folder ``folder`` (resuming ``folder.partial`` when
    an earlier try was interrupted); the caller holds the folder's lock. ``on_task(i)`` is
    called after task ``i`` is committed (tests interrupt there)."""
    if (folder / "meta.json").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    dtype = shard_dtype(vocab)
    state = _progress_record(plan, partial, dtype)
    files = _Files(partial, dtype.itemsize)
    files.open(state["lengths"])
    bar = _bar(plan, state, progress)
    results = _results(plan, plan.tasks[state["done"] :], tokenizer_json, eos, dtype, workers)
    try:
        _write_tasks(results, files, state, partial / "progress.json", bar, on_task)
    finally:
        results.close()  # an error or Ctrl-C: the workers stop now
        files.close()
        if bar is not None:
            bar.close()
    lengths = state["lengths"]
    meta = {
        "format": FORMAT,
        "dtype": dtype.str,
        "vocab": vocab,
        "eos": eos,
        "tokens": {s: lengths[s][0] for s in SPLITS},
        "documents": {s: lengths[s][1] for s in SPLITS},
        "input_bytes": state["bytes"],
        "source": plan.description,
        "mode": plan.mode,
        "corpus_key": plan.key,
    }
    (partial / "tokenizer.json").write_text(tokenizer_json)
    (partial / "progress.json").unlink()
    _write_json(partial / "meta.json", meta)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete leftover (no meta.json)
    os.replace(partial, folder)
    return folder


def _progress_record(plan: Plan, partial: Path, dtype: np.dtype) -> dict[str, Any]:
    """``partial/progress.json``: the one an interrupted try of this plan left, else a fresh
    record in an emptied ``partial`` (tasks done, the files' lengths, input bytes read)."""
    state_path = partial / "progress.json"
    state = None
    if state_path.is_file():
        state = json.loads(state_path.read_text())
        if state.get("plan") != _plan_digest(plan) or state.get("dtype") != dtype.str:
            state = None  # another cut of the same content (another nxd-train): start again
    if state is None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        state = {"plan": _plan_digest(plan), "dtype": dtype.str, "done": 0,
                 "lengths": {s: [0, 0] for s in SPLITS}, "bytes": 0}  # fmt: skip
        _write_json(state_path, state)
    return state


def _write_tasks(
    results: Any, files: _Files, state: dict[str, Any], state_path: Path, bar: Any,
    on_task: Callable[[int], None] | None,
) -> None:  # fmt: skip
    """Append each task's ids and document ends (shifted to the split's offset) to the files,
    then commit it: flush, record the task done and the new lengths in ``state_path``."""
    started = time.perf_counter()
    made = 0
    for task, (ids, ends) in results:
        lengths = state["lengths"]
        for s, split in enumerate(SPLITS):
            files.append(split, ids[s], ends[s] + np.uint64(lengths[split][0]))
            lengths[split][0] += len(ids[s])
            lengths[split][1] += len(ends[s])
        files.flush()
        state["done"] = task.index + 1
        state["bytes"] += task.measure
        _write_json(state_path, state)
        made += len(ids[0]) + len(ids[1])
        if bar is not None:
            bar.update(task.measure)
            rate = made / max(1e-9, time.perf_counter() - started)
            bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
        if on_task is not None:
            on_task(task.index)
    files.flush(sync=True)


def _plan_digest(plan: Plan) -> str:
    """What the progress of a partial folder counts in: the plan's tasks."""
    import hashlib

    cuts = [[(g.source, g.start, g.end, g.split, g.then) for g in t.segments] for t in plan.tasks]
    return hashlib.blake2b(json.dumps([plan.key, cuts]).encode(), digest_size=16).hexdigest()


def _bar(plan: Plan, state: dict[str, Any], progress: bool) -> Any:
    if not progress:
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the workers are forked after the bar starts
    done = sum(t.measure for t in plan.tasks[: state["done"]])
    return tqdm(
        total=sum(t.measure for t in plan.tasks), initial=done, unit="B", unit_scale=True,
        unit_divisor=1000, desc="tokenizing", file=sys.stderr, dynamic_ncols=True,
        mininterval=0.5,
    )  # fmt: skip


def _results(
    plan: Plan, todo: list[Task], tokenizer_json: str, eos: int, dtype: np.dtype,
    workers: int | None,
) -> Any:  # fmt: skip
    """``(task, result)`` in task order: in this process for one worker or one task, else
    from a pool of ``workers`` processes with a bounded window of tasks in flight."""
    workers = min(workers or workers_default(), len(todo))
    if workers <= 1:
        _setup(plan, tokenizer_json, eos, dtype.str)
        try:
            for task in todo:
                yield task, tokenize_task(task)
        finally:
            _STATE.clear()
        return
    from concurrent.futures import FIRST_COMPLETED, wait

    executor = _start_pool(plan, tokenizer_json, eos, dtype, workers)
    finished = False
    try:
        queue = iter(todo)
        pending: collections.deque[tuple[Task, Any]] = collections.deque()
        for task in queue:
            pending.append((task, _submit(executor, task)))
            if len(pending) >= workers * _PER_WORKER:
                break
        while pending:
            task, future = pending.popleft()
            while not future.done():
                wait([future], timeout=0.2, return_when=FIRST_COMPLETED)  # Ctrl-C seen at once
            out = future.result()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append((nxt, _submit(executor, nxt)))
            yield task, out
        finished = True
    finally:
        _stop_pool(executor, finished)


def _start_pool(
    plan: Plan, tokenizer_json: str, eos: int, dtype: np.dtype, workers: int
) -> ProcessPoolExecutor:
    """``workers`` tokenizing processes, forked where there is fork (Linux: as torch's
    DataLoader and `datasets` do; a script needs no ``if __name__ == "__main__"`` guard), else
    spawned. The tokenizer's threads stay off in the workers (TOKENIZERS_PARALLELISM, read
    when they start: also silences its fork warning)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(method), initializer=_init_worker,
        initargs=(plan, tokenizer_json, eos, dtype.str),
    )  # fmt: skip


def _submit(executor: ProcessPoolExecutor, task: Task) -> Future[Any]:
    """``tokenize_task(task)`` on the pool. Workers start during submit, and are born with
    SIGINT blocked (the mask is inherited): Ctrl-C in a terminal reaches the whole process
    group, and only this process acts on it (it stops the workers)."""
    saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return executor.submit(tokenize_task, task)
    finally:
        _restore_env("TOKENIZERS_PARALLELISM", saved_env)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stop_pool(executor: ProcessPoolExecutor, finished: bool) -> None:
    """Shut the pool down: waiting for it after the last task, else (an error or an
    interrupt) at once, its processes terminated."""
    if finished:
        executor.shutdown(wait=True)
        return
    processes = list(getattr(executor, "_processes", {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# --- reading -----------------------------------------------------------------------------------
class TokenShards:
    """A complete shards folder, memory-mapped."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        if not meta_path.is_file():
            raise ConfigError(f"{self.folder} holds no complete token shards (no meta.json)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ConfigError(
                f"{self.folder} holds token shards of format {self.meta.get('format')}, this "
                f"nxd-train reads format {FORMAT}: delete the folder to prepare them again"
            )
        self.dtype = np.dtype(self.meta["dtype"])
        self.key = self.folder.name

    def tokens(self, split: str) -> np.ndarray:
        """The split's token ids (a read-only memory map; empty for an empty split)."""
        n = int(self.meta["tokens"][split])
        path = self.folder / f"{split}.bin"
        if n == 0:
            return np.empty(0, self.dtype)
        if path.stat().st_size != n * self.dtype.itemsize:
            raise ConfigError(f"{path} has {path.stat().st_size} bytes, meta.json says {n} ids")
        return _map(path, self.dtype, n)

    def document_ends(self, split: str) -> np.ndarray:
        """The end (exclusive) of every document of the split, in tokens (memory-mapped)."""
        n = int(self.meta["documents"][split])
        if n == 0:
            return np.empty(0, np.uint64)
        return _map(self.folder / f"{split}.idx", np.dtype("<u8"), n)

    def blocks(self, split: str, seq_len: int) -> Blocks:
        """The split's blocks, read with ``pread`` (see :class:`TokenFile`)."""
        n = int(self.meta["tokens"][split])
        self.tokens(split)  # checks the file's size
        tokens = TokenFile(self.folder / f"{split}.bin", self.dtype, n) if n else self.tokens(split)
        return Blocks(tokens, seq_len, f"{self.key}/{split}")


def _map(path: Path, dtype: np.dtype, n: int) -> np.ndarray:
    """``n`` items of ``dtype`` from ``path``, memory-mapped read-only, with ``MADV_RANDOM``:
    a read faults in its own pages only (no read-ahead), so what a rank holds is what it
    read, whatever the file's size."""
    import mmap

    with path.open("rb") as handle:
        mapped = mmap.mmap(handle.fileno(), n * dtype.itemsize, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype, count=n)


class TokenFile:
    """A split's ids read with ``pread`` (``POSIX_FADV_RANDOM``: no read-ahead): a row read
    is copied into this process and nothing else is mapped or kept, so a rank's memory holds
    the rows it asked for, whatever the file's size."""

    def __init__(self, path: Path, dtype: np.dtype, count: int) -> None:
        self.path, self.dtype, self.count = path, dtype, count
        self._fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, length: int) -> np.ndarray:
        """Ids ``[start, start + length)``."""
        size = self.dtype.itemsize
        data = os.pread(self._fd, length * size, start * size)
        if len(data) != length * size:
            raise OSError(f"{self.path}: short read at id {start} (the file was cut?)")
        return np.frombuffer(data, dtype=self.dtype)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class Blocks:
    """A split cut into ``len(self)`` blocks of ``seq_len`` tokens (the tail shorter than a
    block is left out): ``blocks[rows]`` reads only those rows, as an int64 tensor
    ``(len(rows), seq_len)`` (``(seq_len,)`` for one int). ``tokens``: a :class:`TokenFile`
    (what training reads) or an array."""

    def __init__(self, tokens: TokenFile | np.ndarray, seq_len: int, key: str = "") -> None:
        self.seq_len = seq_len
        self.key = key
        self._tokens = tokens
        self._n = len(tokens) // seq_len

    def __len__(self) -> int:
        return self._n

    def _row(self, i: int) -> np.ndarray:
        if not -self._n <= i < self._n:
            raise IndexError(f"block {i} out of range for {self._n} blocks")
        i %= self._n
        start = i * self.seq_len
        if isinstance(self._tokens, TokenFile):
            return self._tokens.read(start, self.seq_len)
        return np.asarray(self._tokens[start : start + self.seq_len])

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice):
            index = range(*index.indices(self._n))
        if isinstance(index, (int, np.integer)):
            return torch.from_numpy(self._row(int(index)).astype(np.int64))
        if isinstance(index, torch.Tensor):
            index = index.tolist()
        rows = [self._row(int(i)) for i in index]
        out = np.stack(rows) if rows else np.empty((0, self.seq_len))
        return torch.from_numpy(out.astype(np.int64))

    @property
    def shape(self) -> tuple[int, int]:
        return (self._n, self.seq_len)
