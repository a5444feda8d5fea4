"""Text in, packed token blocks out: the corpus, its train/validation split, the tokenizer
and the data-parallel loader.

* **Corpus**: ``--data`` (a text file, a folder of text files, a ``datasets`` folder saved with
  ``save_to_disk``), else the Python standard library's own ``.py`` sources, found through
  ``sysconfig`` (real text wherever Python is, no download). A file is text by its content,
  whatever its name (no NUL byte in its first 8000 bytes, git's rule); ``.git``, ``.hg`` and
  ``.svn`` folders are skipped. Every text is cut into documents of about 64 KiB (at line
  ends), named ``<file>#<i>``; a document goes to validation when ``crc32(its name) mod
  10_000 < val_fraction · 10_000``: the split depends only on names. A corpus too small for
  that to give both splits (a few documents) holds out its last ``val_fraction`` instead.
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
from nxd_trainer.train.rundir import replace_dir

__all__ = [
    "EOS",
    "Corpus",
    "PackedLoader",
    "check_inputs",
    "load_corpus",
    "prepare_data",
    "prepare_lock",
]

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
_CHUNK = 1 << 16  # texts are cut into documents of about 64 KiB (at newlines)
_SNIFF = 8000  # a file holding a NUL byte in its first 8000 bytes is binary (git's rule)
_SKIPPED_DIRS = {".git", ".hg", ".svn"}
_ENCODE_BATCH = 256  # documents per tokenizer call (Ctrl-C is seen between calls)


@dataclass
class Corpus:
    """Documents of the training and validation splits, and where they came from."""

    train: list[str]
    valid: list[str]
    source: str


def _is_validation(name: str, fraction: float) -> bool:
    return zlib.crc32(name.encode("utf-8")) % 10_000 < round(fraction * 10_000)


def _read_text(path: Path) -> str | None:
    """The file's text, or None when its content is binary (whatever its name)."""
    data = path.read_bytes()
    if b"\x00" in data[:_SNIFF]:
        return None
    return data.decode("utf-8", errors="replace")


def _split_named(
    named: Iterator[tuple[str, str]], fraction: float, budget: int, source: str
) -> Corpus:
    """Documents (``name``, text) cut into ~64 KiB pieces and split by a hash of their name;
    a corpus too small for the hash to give both splits holds out its last ``fraction``."""
    pieces: list[tuple[str, str]] = []
    size = 0
    for name, text in named:
        if not text.strip():
            continue
        pieces.extend((f"{name}#{i}", chunk) for i, chunk in enumerate(_chunks(text)))
        size += len(text.encode("utf-8"))
        if budget and size >= budget:
            break
    if not pieces:
        raise ConfigError(f"the corpus {source} has no text")
    train = [text for name, text in pieces if not _is_validation(name, fraction)]
    valid = [text for name, text in pieces if _is_validation(name, fraction)]
    if train and valid:
        return Corpus(train, valid, source)
    train, valid = _tail_split([text for _, text in pieces], fraction)
    logger.info(
        "the corpus %s has %d document(s): its last %.0f%% is the validation split",
        source, len(pieces), 100 * fraction,
    )  # fmt: skip
    return Corpus(train, valid, source)


def _tail_split(texts: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """The last ``fraction`` of the documents (of the text, for one document: cut at the
    line end nearest the cut point) is validation; the rest is training."""
    if len(texts) >= 2:
        held = min(len(texts) - 1, max(1, round(fraction * len(texts))))
        return texts[:-held], texts[-held:]
    text = texts[0]
    cut = round(len(text) * (1 - fraction))
    line_end = text.rfind("\n", 0, cut)
    if line_end > 0:
        cut = line_end + 1
    cut = min(max(cut, 1), len(text) - 1) if len(text) > 1 else len(text)
    return [text[:cut]], [text[cut:]]


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


def check_inputs(cfg: TrainConfig) -> None:
    """The paths the run reads exist (checked before anything is written)."""
    if cfg.data is not None and not Path(cfg.data).expanduser().exists():
        raise ConfigError(f"data path {cfg.data!r} does not exist")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).expanduser().is_dir():
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} is not a folder")


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
        return _split_named(
            iter([(path.name, text)]), cfg.val_fraction, budget, f"file {cfg.data!r}"
        )
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not _SKIPPED_DIRS.intersection(p.relative_to(path).parts[:-1])
    )

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


def _token_ids(tokenizer: Any, texts: list[str]) -> list[int]:
    """Every document's ids followed by EOS, concatenated (documents are encoded in batches,
    so Ctrl-C is seen between them)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    for start in range(0, len(texts), _ENCODE_BATCH):
        batch = texts[start : start + _ENCODE_BATCH]
        if backend is not None:
            encoded = [e.ids for e in backend.encode_batch(batch, add_special_tokens=False)]
        else:
            encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in batch]
        for doc in encoded:
            ids.extend(doc)
            ids.append(eos)
    return ids


def _blocks(ids: list[int], seq_len: int) -> torch.Tensor:
    """``ids`` cut into ``(n, seq_len)`` blocks; the tail shorter than a block is dropped."""
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.int32).view(n, seq_len)


def _fingerprint(cfg: TrainConfig) -> str:
    keys = ("data", "text_field", "tokenizer", "vocab_size", "seq_len", "corpus_mb", "val_fraction")
    return hashlib.sha256(
        json.dumps({k: getattr(cfg, k) for k in keys}, sort_keys=True).encode()
    ).hexdigest()[:16]


def _check_enough(source: str, train: list[int], valid: list[int], seq_len: int) -> None:
    """Both splits must hold a block of ``seq_len`` tokens: else name the value that works."""
    if len(train) >= seq_len and len(valid) >= seq_len:
        return
    fits = min(len(train), len(valid))
    hint = (
        f"use --seq-len {fits} or less, or give more text"
        if fits >= 2
        else "give more text (or a larger val_fraction)"
    )
    raise ConfigError(
        f"the corpus {source} gives {len(train)} training and {len(valid)} validation tokens, "
        f"too few for one sequence of seq_len {seq_len} in each; {hint}"
    )


def prepare_data(cfg: TrainConfig, *, build: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The tokenizer and the packed train/validation blocks ``(n, seq_len)`` of the run.

    With ``build`` this process makes whatever is missing from the run folder (the tokenizer,
    the packed ids): everything is computed first, then written under temporary names and
    renamed, ``data/meta.json`` last, so an error or Ctrl-C leaves the folder as it was.
    Without ``build`` it reads what is there.
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
        train_ids, valid_ids = (_token_ids(tokenizer, t) for t in (corpus.train, corpus.valid))
        _check_enough(corpus.source, train_ids, valid_ids, cfg.seq_len)
        train, valid = _blocks(train_ids, cfg.seq_len), _blocks(valid_ids, cfg.seq_len)
        meta = {
            "fingerprint": fingerprint,
            "source": corpus.source,
            "documents": [len(corpus.train), len(corpus.valid)],
            "tokens": [len(train_ids), len(valid_ids)],
            "sequences": [len(train), len(valid)],
            "vocab": len(tokenizer),
        }
        data_dir.mkdir(parents=True, exist_ok=True)
        suffix = f".{os.getpid()}.tmp"
        tmp_tok, tmp_blocks = run / f".tokenizer{suffix}", data_dir / f".blocks{suffix}"
        tmp_meta = data_dir / f".meta{suffix}"
        try:
            tokenizer.save_pretrained(str(tmp_tok))
            save_file({"train": train, "valid": valid}, str(tmp_blocks))
            tmp_meta.write_text(json.dumps(meta, indent=1))
            meta_path.unlink(missing_ok=True)  # the old cache is invalid from here on
            replace_dir(tmp_tok, tok_dir)
            os.replace(tmp_blocks, data_dir / "blocks.safetensors")
            os.replace(tmp_meta, meta_path)
        finally:
            import shutil

            shutil.rmtree(tmp_tok, ignore_errors=True)
            tmp_blocks.unlink(missing_ok=True)
            tmp_meta.unlink(missing_ok=True)
    if not meta_path.is_file():
        raise ConfigError(f"no prepared data in {data_dir}")  # a rank read before the barrier
    tokenizer = load_tokenizer(tok_dir)
    blocks = load_file(str(data_dir / "blocks.safetensors"))
    return tokenizer, blocks["train"], blocks["valid"]


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
    """An exclusive lock on the run folder's data (launchers of several nodes sharing the
    folder prepare in turn; the later ones find the cache)."""
    from filelock import FileLock

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(cfg.run_dir / ".prepare.lock"))
