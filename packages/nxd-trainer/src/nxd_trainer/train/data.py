"""Text in, packed token blocks out: the corpus, its train/validation split, the tokenizer
and the data-parallel loader.

* **Corpus**: ``--data`` (a text file, a folder of text files, a ``datasets`` folder saved with
  ``save_to_disk``), else the Python standard library's own ``.py`` sources, found through
  ``sysconfig`` (real text wherever Python is, no download). A document goes to validation
  when ``crc32(its name) mod 10_000 < val_fraction · 10_000``: the split depends only on names.
* **Tokenizer**: a byte-level BPE trained with Hugging Face ``tokenizers`` on the training
  split (deterministic), saved as an HF tokenizer folder in the run; or ``--tokenizer DIR``.
* **Packing**: every document's ids, then ``<|endoftext|>``, concatenated and cut into blocks
  of ``seq_len`` tokens (the tail shorter than a block is dropped), cached in the run as
  safetensors with a fingerprint of the settings that made them.
* **Loader**: the global stream is epoch after epoch of the blocks, each epoch permuted by
  ``randperm(n, seed + epoch)``; step ``s`` takes global sequences ``[s·B, (s+1)·B)``,
  micro-step ``m`` of ``k`` its ``m``-th ``B/k``, and DP rank ``d`` of ``D`` the ``d``-th
  ``B/(k·D)`` of those. The position is the number of sequences consumed, saved in the
  checkpoint: the same global batches at any DP degree or accumulation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nxd_trainer.train.config import ConfigError, TrainConfig

__all__ = ["EOS", "Corpus", "PackedLoader", "load_corpus", "prepare_data"]

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".tex", ".html", ""}
_CHUNK = 1 << 16  # a single text file is split into documents of about 64 KiB (at newlines)


@dataclass
class Corpus:
    """Documents of the training and validation splits, and where they came from."""

    train: list[str]
    valid: list[str]
    source: str


def _is_validation(name: str, fraction: float) -> bool:
    return zlib.crc32(name.encode("utf-8")) % 10_000 < round(fraction * 10_000)


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\x00" in data[:4096]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def _split_named(
    named: Iterator[tuple[str, str]], fraction: float, budget: int, source: str
) -> Corpus:
    train, valid, size = [], [], 0
    for name, text in named:
        if not text.strip():
            continue
        (valid if _is_validation(name, fraction) else train).append(text)
        size += len(text.encode("utf-8"))
        if budget and size >= budget:
            break
    if not train or not valid:
        raise ConfigError(
            f"the corpus {source} has no text"
            if not train and not valid
            else f"the corpus {source} is too small to split into training and validation "
            f"documents ({len(train)} / {len(valid)}); give more text or another val_fraction"
        )
    return Corpus(train, valid, source)


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


def _chunks(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def load_corpus(cfg: TrainConfig) -> Corpus:
    """The documents of ``cfg.data`` (or the standard library), split train/validation."""
    budget = int(cfg.corpus_mb * 1e6)
    if cfg.data is None:
        root, files = _stdlib_files()
        named = ((p.relative_to(root).as_posix(), _read_text(p) or "") for p in files)
        return _split_named(named, cfg.val_fraction, budget, f"standard library at {root}")
    path = Path(cfg.data).expanduser()
    if not path.exists():
        raise ConfigError(f"data path {cfg.data!r} does not exist")
    if path.is_dir() and any(
        (path / n).exists() for n in ("dataset_info.json", "dataset_dict.json")
    ):
        return _load_datasets(path, cfg, budget)
    if path.is_file():
        text = _read_text(path)
        if text is None:
            raise ConfigError(f"data file {cfg.data!r} is not text (it holds NUL bytes)")
        named = ((f"{path.name}#{i}", chunk) for i, chunk in enumerate(_chunks(text)))
        return _split_named(named, cfg.val_fraction, budget, f"file {cfg.data!r}")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)

    def named_files() -> Iterator[tuple[str, str]]:
        for p in files:
            text = _read_text(p)
            if text is not None:
                yield p.relative_to(path).as_posix(), text

    return _split_named(named_files(), cfg.val_fraction, budget, f"folder {cfg.data!r}")


def _load_datasets(path: Path, cfg: TrainConfig, budget: int) -> Corpus:
    try:
        import datasets
    except ModuleNotFoundError:
        raise ConfigError(
            f"{str(path)!r} is a `datasets` folder: install the `datasets` package to read it"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    source = f"datasets folder {str(path)!r}"
    if isinstance(loaded, datasets.DatasetDict):
        train_split = "train" if "train" in loaded else next(iter(loaded))
        valid_split = next((s for s in ("validation", "valid", "test") if s in loaded), None)
        parts = [loaded[train_split]] + ([loaded[valid_split]] if valid_split else [])
    else:
        parts = [loaded]
    for part in parts:
        if cfg.text_field not in part.column_names:
            raise ConfigError(
                f"{source} has no column {cfg.text_field!r} (text_field); its columns: "
                f"{part.column_names}"
            )
    if len(parts) == 2:  # the folder's own split
        texts = [[t for t in p[cfg.text_field] if isinstance(t, str) and t.strip()] for p in parts]
        if not texts[0] or not texts[1]:
            raise ConfigError(f"{source} has no text in column {cfg.text_field!r}")
        return Corpus(texts[0], texts[1], source)
    named = ((str(i), t) for i, t in enumerate(parts[0][cfg.text_field]) if isinstance(t, str))
    return _split_named(named, cfg.val_fraction, budget, source)


# --- tokenizer ------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
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
    return tokenizer


def _pack(tokenizer: Any, texts: list[str], seq_len: int) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if backend is not None:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        for encoding in encodings:
            ids.extend(encoding.ids)
            ids.append(eos)
    else:
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.append(eos)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.int32).view(n, seq_len)


def _fingerprint(cfg: TrainConfig) -> str:
    keys = ("data", "text_field", "tokenizer", "vocab_size", "seq_len", "corpus_mb", "val_fraction")
    return hashlib.sha256(
        json.dumps({k: getattr(cfg, k) for k in keys}, sort_keys=True).encode()
    ).hexdigest()[:16]


def prepare_data(cfg: TrainConfig, *, build: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The tokenizer and the packed train/validation blocks ``(n, seq_len)`` of the run.

    With ``build`` this process makes whatever is missing from the run folder (the tokenizer,
    the packed ids) and writes it atomically; without it, it reads what is there.
    """
    from safetensors.torch import load_file, save_file

    run = cfg.run_dir
    data_dir = run / "data"
    meta_path = data_dir / "meta.json"
    tok_dir = run / "tokenizer"
    fingerprint = _fingerprint(cfg)
    cached = meta_path.is_file() and json.loads(meta_path.read_text())["fingerprint"] == fingerprint
    if build and not cached:
        corpus = load_corpus(cfg)
        if cfg.tokenizer is not None:
            tokenizer = load_tokenizer(cfg.tokenizer)
        else:
            logger.info("training a byte-level BPE (vocab %d) on %s", cfg.vocab_size, corpus.source)
            tokenizer = train_tokenizer(corpus.train, cfg.vocab_size)
        tmp = run / f".tokenizer.{os.getpid()}"
        tokenizer.save_pretrained(str(tmp))
        _replace_dir(tmp, tok_dir)
        train, valid = (_pack(tokenizer, t, cfg.seq_len) for t in (corpus.train, corpus.valid))
        if len(train) == 0 or len(valid) == 0:
            raise ConfigError(
                f"the corpus {corpus.source} gives {len(train)} training / {len(valid)} "
                f"validation sequences of {cfg.seq_len} tokens: too little text"
            )
        data_dir.mkdir(parents=True, exist_ok=True)
        tmp_file = data_dir / f".blocks.{os.getpid()}"
        save_file({"train": train, "valid": valid}, str(tmp_file))
        os.replace(tmp_file, data_dir / "blocks.safetensors")
        meta = {
            "fingerprint": fingerprint,
            "source": corpus.source,
            "documents": [len(corpus.train), len(corpus.valid)],
            "sequences": [len(train), len(valid)],
            "vocab": len(tokenizer),
        }
        tmp_meta = data_dir / f".meta.{os.getpid()}"
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_meta, meta_path)
    if not meta_path.is_file():
        raise ConfigError(f"no prepared data in {data_dir}")  # a rank read before the barrier
    tokenizer = load_tokenizer(tok_dir)
    blocks = load_file(str(data_dir / "blocks.safetensors"))
    return tokenizer, blocks["train"], blocks["valid"]


def _replace_dir(tmp: Path, target: Path) -> None:
    import shutil

    if target.exists():
        old = target.with_name(f".{target.name}.old.{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


# --- loader ---------------------------------------------------------------------------------
class PackedLoader:
    """This DP rank's slice of each global batch of packed blocks (see the module docstring)."""

    def __init__(
        self, blocks: torch.Tensor, batch_size: int, dp_rank: int, dp_size: int, seed: int
    ) -> None:
        self.blocks = blocks
        self.batch_size = batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.consumed = 0  # global sequences consumed so far
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.blocks), generator=generator)
        return self._perm

    def next_batch(self) -> torch.Tensor:
        """The next global batch's share of this rank, ``(batch_size / dp, seq_len)`` int64."""
        n, share = len(self.blocks), self.batch_size // self.dp_size
        start = self.consumed + self.dp_rank * share
        rows = []
        for g in range(start, start + share):
            rows.append(int(self._order(g // n)[g % n]))
        self.consumed += self.batch_size
        return self.blocks[rows].long()

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "num_blocks": len(self.blocks), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_blocks"]) != len(self.blocks) or int(state["seed"]) != self.seed:
            raise ConfigError(
                f"the checkpoint's data ({state['num_blocks']} blocks, seed {state['seed']}) is "
                f"not this run's ({len(self.blocks)} blocks, seed {self.seed}): the data or "
                "seed changed since it was saved; use another --name"
            )
        self.consumed = int(state["consumed"])


def prepare_lock(cfg: TrainConfig) -> Any:
    """An exclusive lock on the run folder's data (two launchers of one host prepare in turn;
    the second finds the cache)."""
    import contextlib
    import fcntl

    @contextlib.contextmanager
    def lock() -> Iterator[None]:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        with open(cfg.run_dir / ".prepare.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    return lock()
