"""Text in, token blocks out: the run's tokenizer, its token shards (made once per corpus and
tokenizer, shared by every run) and the data-parallel loader that reads them.

* **Corpus**: :mod:`nxd_trainer.train.corpus` (inputs by content, documents, the split by
  content hashes, the plan of tasks, the content key).
* **Tokenizer**: ``--tokenizer DIR`` (a Hugging Face tokenizer folder), else a byte-level BPE
  (``tokenizers``, deterministic) trained on a sample of at most ``BPE_SAMPLE`` = 8 MiB of the
  training split (tasks spread evenly over the corpus): its cost does not grow with the corpus.
  It is cached under ``<cache>/bpe/<key>/`` (key: the corpus key, the vocabulary size) and
  copied into the run folder (``tokenizer/``, what the export ships).
* **Shards**: :mod:`nxd_trainer.train.shards`, under ``<cache>/tokens/<key>/`` (key: the corpus
  key and the tokenizer's JSON); ``<cache>`` is ``<runs_dir>/.cache`` or ``$NXD_TRAIN_CACHE``.
  The run folder's ``data/meta.json`` names its shards and the settings that chose them: a
  rerun with the same settings opens them without reading the corpus again.
* **Blocks**: each split is cut into blocks of ``seq_len`` tokens (documents packed, EOS between
  them; the tail shorter than a block is left out), read from the memory map.
* **Loader**: the global stream is epoch after epoch of the training blocks, epoch ``e``
  permuted by ``π_e`` (a 4-round Feistel network keyed by the seed and ``e``, cycle-walked onto
  ``[0, n)``: a bijection computed per index, no table, so memory does not grow with ``n``);
  step ``s`` takes global sequences ``[s·B, (s+1)·B)``, micro-step ``m`` of ``k`` its ``m``-th
  ``B/k`` and DP rank ``d`` of ``D`` the ``d``-th ``B/(k·D)`` of those. The position is the number
  of sequences consumed, saved in the checkpoint: the same global batches at any DP degree or
  accumulation, and each rank reads only its own rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nxd_trainer.train.config import ConfigError, TrainConfig
from nxd_trainer.train.corpus import TASK, TRAIN, Corpus, Plan, iter_units, load_corpus
from nxd_trainer.train.inputs import check_data
from nxd_trainer.train.rundir import replace_dir

__all__ = [
    "BPE_SAMPLE",
    "EOS",
    "Corpus",
    "PackedLoader",
    "bpe_sample",
    "cache_root",
    "check_inputs",
    "load_corpus",
    "load_tokenizer",
    "prepare_data",
    "prepare_lock",
    "train_tokenizer",
]

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
BPE_SAMPLE = 8 << 20  # bytes of training text the BPE learns from, at most
_BPE_FORMAT = 1
_DATA_FORMAT = 2  # of the run folder's data/meta.json (1: data/blocks.safetensors)
ORDER = "feistel-1"  # the loader's order (saved in checkpoints)


def check_inputs(cfg: TrainConfig) -> None:
    """The paths the run reads exist (checked before anything is written)."""
    check_data(cfg)
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).expanduser().is_dir():
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} is not a folder")


def cache_root(cfg: TrainConfig) -> Path:
    """Where token shards and trained tokenizers are shared: ``$NXD_TRAIN_CACHE``, else
    ``<runs_dir>/.cache``."""
    return Path(os.environ.get("NXD_TRAIN_CACHE") or Path(cfg.runs_dir) / ".cache")


# --- tokenizer ------------------------------------------------------------------------------
def train_tokenizer(texts: Any, vocab_size: int) -> Any:
    """A byte-level BPE (``tokenizers``) trained on ``texts``, as a ``transformers`` fast
    tokenizer with ``<|endoftext|>`` as its BOS/EOS/pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=EOS
    )


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"tokenizer {str(path)!r} is not a folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise ConfigError(f"tokenizer {str(path)!r} could not be loaded: {error}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {str(path)!r} has no EOS token (needed between documents)")
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ConfigError(
            f"tokenizer {str(path)!r} has no fast (tokenizers) version: nxd-train encodes "
            "with `tokenizers` (a folder with tokenizer.json)"
        )
    return tokenizer


def bpe_sample(plan: Plan, budget: int = BPE_SAMPLE) -> list[str]:
    """At most ``budget`` bytes of training text: whole tasks spread evenly over the corpus
    (all of it when it is smaller)."""
    tasks = plan.tasks
    if plan.measure > budget:
        m = max(1, budget // TASK)
        picks = sorted({(2 * k + 1) * len(tasks) // (2 * m) for k in range(m)})
        tasks = [tasks[i] for i in picks]
    texts, size = [], 0
    for task in tasks:
        for split, text, _ in iter_units(plan, task):
            if split == TRAIN and size < budget:
                texts.append(text)
                size += len(text)
        if size >= budget:
            break
    return texts


def _hash(*parts: Any) -> str:
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()


def _run_tokenizer(cfg: TrainConfig, plan: Plan) -> Any:
    """``--tokenizer``, else the BPE of this corpus and vocabulary (cached, else trained)."""
    if cfg.tokenizer is not None:
        return load_tokenizer(Path(cfg.tokenizer).expanduser())
    folder = cache_root(cfg) / "bpe" / _hash(plan.key, cfg.vocab_size, BPE_SAMPLE, _BPE_FORMAT)
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    logger.info("training a byte-level BPE (vocab %d) on %s", cfg.vocab_size, plan.description)
    tokenizer = train_tokenizer(bpe_sample(plan), cfg.vocab_size)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    try:
        tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, folder)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


# --- preparation ----------------------------------------------------------------------------
def _fingerprint(cfg: TrainConfig) -> str:
    keys = ("data", "text_field", "tokenizer", "vocab_size", "corpus_mb", "val_fraction")
    return _hash(_DATA_FORMAT, {k: getattr(cfg, k) for k in keys})


def _check_enough(source: str, train: int, valid: int, seq_len: int, batch_size: int) -> None:
    """The training split must hold one batch of distinct sequences of ``seq_len`` tokens and
    the validation split one sequence: else name the values that work."""
    if train // seq_len >= batch_size and valid >= seq_len:
        return
    fits = min(train // batch_size, valid)
    hints = [f"--seq-len {fits} or less"] if fits >= 2 else []
    if valid >= seq_len and train >= seq_len:
        hints.append(f"--batch-size {train // seq_len} or less")
    hint = f"use {' or '.join(hints)}, or give more text" if hints else "give more text"
    raise ConfigError(
        f"the corpus {source} gives {train} training and {valid} validation tokens, too few "
        f"for a batch of {batch_size} distinct sequences of seq_len {seq_len} (and one for "
        f"validation); {hint}"
    )


def _say(cfg: TrainConfig, text: str) -> None:
    if cfg.progress:
        print(f"nxd-train: {text}", file=sys.stderr, flush=True)


def _recorded_shards(cfg: TrainConfig, meta_path: Path) -> Path | None:
    """The shards the run folder names, if its settings are this command's and they exist."""
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        return None
    if meta.get("fingerprint") != _fingerprint(cfg):
        return None
    for folder in (Path(meta.get("shards_dir", "")), cache_root(cfg) / "tokens" / meta["shards"]):
        if (folder / "meta.json").is_file():
            return folder
    return None


def prepare_data(
    cfg: TrainConfig, *, build: bool, workers: int | None = None
) -> tuple[Any, Any, Any]:
    """The tokenizer and the train/validation :class:`~nxd_trainer.train.shards.Blocks` of
    the run (memory-mapped).

    With ``build`` this process makes whatever is missing: the tokenizer, the token shards
    (``workers`` processes, default: this machine's cores), the run folder's record of them
    (an error or Ctrl-C leaves the run folder as it was). Without ``build`` it reads what is
    there.
    """
    from nxd_trainer.train.shards import TokenShards

    run = cfg.run_dir
    data_dir = run / "data"
    tok_dir = run / "tokenizer"
    if (data_dir / "blocks.safetensors").exists():
        raise ConfigError(
            f"the run folder {run} holds data packed by an earlier nxd-train "
            "(data/blocks.safetensors): its checkpoints' data order cannot be rebuilt from "
            "token shards; use another --name (the corpus is prepared once for all runs)"
        )
    folder = _recorded_shards(cfg, data_dir / "meta.json")
    if folder is None or not tok_dir.is_dir():
        if not build:
            raise ConfigError(f"no prepared data in {data_dir}")  # a rank read before the barrier
        folder = _make_run_data(cfg, workers)
    tokenizer = load_tokenizer(tok_dir)
    shards = TokenShards(folder)
    tokens = shards.meta["tokens"]
    source = shards.meta["source"]
    _check_enough(source, tokens["train"], tokens["valid"], cfg.seq_len, cfg.batch_size)
    return tokenizer, shards.blocks("train", cfg.seq_len), shards.blocks("valid", cfg.seq_len)


def _make_run_data(cfg: TrainConfig, workers: int | None) -> Path:
    """The run's data, made: the plan of the corpus (reading it once to hash it), the
    tokenizer, the token shards (:func:`_cached_shards`), then the run folder's ``tokenizer/``
    and ``data/meta.json``, written under temporary names and renamed (``meta.json`` last), so
    an error or Ctrl-C leaves the run folder as it was. Returns the shards folder."""
    from nxd_trainer.train.shards import TokenShards

    started = time.perf_counter()
    plan = _plan(cfg)
    tokenizer = _run_tokenizer(cfg, plan)
    folder, found = _cached_shards(cfg, plan, tokenizer, workers)
    shards = TokenShards(folder)
    tokens = shards.meta["tokens"]
    _check_enough(plan.description, tokens["train"], tokens["valid"], cfg.seq_len, cfg.batch_size)
    meta = {
        "format": _DATA_FORMAT,
        "fingerprint": _fingerprint(cfg),
        "shards": folder.name,
        "shards_dir": str(folder.resolve()),
        "source": plan.description,
        "split": plan.mode,
        "documents": shards.meta["documents"],
        "tokens": tokens,
        "vocab": len(tokenizer),
    }
    _publish(cfg.run_dir, tokenizer, meta)
    seconds = time.perf_counter() - started
    what = "found" if found else f"made in {seconds:.1f} s"
    _say(
        cfg,
        f"{plan.description}: {sum(shards.meta['documents'].values()):,} documents, "
        f"{tokens['train']:,} training and {tokens['valid']:,} validation tokens "
        f"({plan.mode} split); token shards {what}: {folder}",
    )
    return folder


def _cached_shards(
    cfg: TrainConfig, plan: Plan, tokenizer: Any, workers: int | None
) -> tuple[Path, bool]:
    """The cache's token shards of (``plan``, ``tokenizer``), and whether they were there
    already: made under the folder's lock if not (``workers`` processes, default: this
    machine's cores; resumed if interrupted; reused if another run made them)."""
    from filelock import FileLock

    from nxd_trainer.train.shards import build_shards

    backend = tokenizer.backend_tokenizer.to_str()
    key = _hash(plan.key, hashlib.blake2b(backend.encode()).hexdigest())
    folder = cache_root(cfg) / "tokens" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f"{key}.lock")):
        found = (folder / "meta.json").is_file()
        if not found:
            build_shards(
                plan, backend, tokenizer.eos_token_id, len(tokenizer), folder,
                workers=workers, progress=cfg.progress,
            )  # fmt: skip
    return folder, found


def _plan(cfg: TrainConfig) -> Plan:
    from nxd_trainer.train.corpus import plan_corpus

    plan = plan_corpus(cfg)
    for note in plan.notes:
        logger.info("the corpus %s: %s", plan.description, note)
    return plan


def _publish(run: Path, tokenizer: Any, meta: dict[str, Any]) -> None:
    """The run folder's tokenizer/ and data/meta.json (renamed into place, meta.json last)."""
    import shutil

    data_dir = run / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    suffix = f".{os.getpid()}.tmp"
    tmp_tok, tmp_meta = run / f".tokenizer{suffix}", data_dir / f".meta{suffix}"
    meta_path = data_dir / "meta.json"
    try:
        tokenizer.save_pretrained(str(tmp_tok))
        tmp_meta.write_text(json.dumps(meta, indent=1))
        meta_path.unlink(missing_ok=True)  # the old record is invalid from here on
        replace_dir(tmp_tok, run / "tokenizer")
        os.replace(tmp_meta, meta_path)
    finally:
        shutil.rmtree(tmp_tok, ignore_errors=True)
        tmp_meta.unlink(missing_ok=True)


def prepare_lock(cfg: TrainConfig) -> Any:
    """An exclusive lock on the run folder's data (launchers of several nodes sharing the
    folder prepare in turn; the later ones find the shards)."""
    from filelock import FileLock

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(cfg.run_dir / ".prepare.lock"))


# --- loader ---------------------------------------------------------------------------------
_M64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """``π(positions)`` for the bijection ``π`` of ``[0, n)`` of ``(seed, epoch)``: a 4-round
    Feistel network on ``2h`` bits (``4^h >= n``), cycle-walked (applied again while the
    result is ``>= n``; fewer than 4 times on average, as ``4^h < 4n``)."""
    x = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return np.zeros_like(x, dtype=np.int64)
    h = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << h) - 1)
    base = _splitmix((seed & _M64) ^ _splitmix(epoch & _M64))
    keys = [np.uint64(_splitmix(base + r)) for r in range(4)]
    c1, c2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    shift = np.uint64(h)

    def rounds(v: np.ndarray) -> np.ndarray:
        left, right = v >> shift, v & mask
        for k in keys:
            z = (right ^ k) * c1
            z = (z ^ (z >> np.uint64(29))) * c2
            z ^= z >> np.uint64(32)
            left, right = right, left ^ (z & mask)
        return (left << shift) | right

    out = x.copy()
    walking = np.ones(out.shape, dtype=bool)
    while walking.any():
        out[walking] = rounds(out[walking])
        walking &= out >= np.uint64(n)
    return out.astype(np.int64)


class PackedLoader:
    """This DP rank's slice of each global batch of blocks (see the module docstring).

    ``blocks``: :class:`~nxd_trainer.train.shards.Blocks` (or any ``(n, seq_len)`` tensor);
    ``blocks[rows]`` is read for this rank's rows only."""

    def __init__(self, blocks: Any, batch_size: int, dp_rank: int, dp_size: int, seed: int) -> None:
        self.blocks = blocks
        self.batch_size = batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.consumed = 0  # global sequences consumed so far

    def rows(self, start: int, count: int) -> np.ndarray:
        """The blocks of global sequences ``[start, start + count)``."""
        n = len(self.blocks)
        g = np.arange(start, start + count, dtype=np.int64)
        epochs, positions = g // n, g % n
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = permute(positions[where], n, self.seed, int(epoch))
        return out

    def next_batch(self) -> torch.Tensor:
        """The next global batch's share of this rank, ``(batch_size / dp, seq_len)`` int64."""
        share = self.batch_size // self.dp_size
        rows = self.rows(self.consumed + self.dp_rank * share, share)
        self.consumed += self.batch_size
        return self.blocks[rows.tolist()].long()

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "num_blocks": len(self.blocks), "seed": self.seed,
                "order": ORDER, "data": getattr(self.blocks, "key", "")}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("order") != ORDER:
            raise ConfigError(
                "the checkpoint's data position was saved by an earlier nxd-train (packed "
                "blocks in another order): it cannot resume bitwise from token shards; use "
                "another --name"
            )
        if int(state["num_blocks"]) != len(self.blocks) or int(state["seed"]) != self.seed:
            raise ConfigError(
                f"the checkpoint's data ({state['num_blocks']} blocks, seed {state['seed']}) is "
                f"not this run's ({len(self.blocks)} blocks, seed {self.seed}): the data or "
                "seed changed since it was saved; use another --name"
            )
        saved, key = state.get("data") or "", getattr(self.blocks, "key", "")
        if saved and key and saved != key:
            raise ConfigError(
                f"the checkpoint's token shards ({saved}) are not this run's ({key}): the "
                "corpus or tokenizer changed since it was saved; use another --name"
            )
        self.consumed = int(state["consumed"])
