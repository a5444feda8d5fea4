"""nxd-train's data without a job: every input kind, the split of small corpora, of few big
files and of many documents, the token shards (what they hold, the same bytes from 1 or 2
workers, reused across runs by content, resumed after an interruption), memory that does not
grow with the corpus (preparation and loader), and the refusals (old run folders, another
corpus under a checkpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nxd_trainer.train import ConfigError, PackedLoader, TrainConfig
from nxd_trainer.train.corpus import load_corpus, plan_corpus
from nxd_trainer.train.data import EOS, prepare_data, train_tokenizer
from nxd_trainer.train.shards import Blocks, TokenShards, build_shards


def _lines(tag: str, n: int, start: int = 0) -> str:
    return "".join(f"{tag} says {i * 7919 % 10007} things about {tag}\n" for i in range(start, n))


def _folder(root: Path, files: dict[str, str | bytes]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def _cfg(tmp_path: Path, data: Path | str | None, **kwargs: Any) -> TrainConfig:
    base = {"runs_dir": str(tmp_path / "runs"), "vocab_size": 300, "seq_len": 16,
            "progress": False}  # fmt: skip
    base.update(kwargs)
    return TrainConfig(data=None if data is None else str(data), **base)


# --- the split -------------------------------------------------------------------------------
def test_small_corpora_hold_out_their_tail(tmp_path: Path) -> None:
    notes = _folder(
        tmp_path / "notes", {f"note{i:02d}.txt": _lines(f"n{i}", 20) for i in range(60)}
    )
    (notes / "image.bin").write_bytes(b"\x00\x01" * 100)  # not text: skipped
    corpus = load_corpus(_cfg(tmp_path, notes, val_fraction=0.2))
    assert (len(corpus.train), len(corpus.valid)) == (48, 12)  # whole notes: the last 20%
    assert corpus.valid[0].startswith("n48 says")
    assert load_corpus(_cfg(tmp_path, notes, val_fraction=0.2)) == corpus
    # One file: its last 20%, from the start of the line holding the cut point.
    one = tmp_path / "one.txt"
    one.write_text("".join(f"line {i}\n" for i in range(100)))
    single = load_corpus(_cfg(tmp_path, one, val_fraction=0.2))
    assert "".join(single.train + single.valid) == one.read_text()
    assert single.valid[0].startswith("line 80\n")


def test_few_big_files_split_inside_them(tmp_path: Path) -> None:
    """The issue's three big files (refused before: "3 / 0"): with few documents, pieces of
    ~64 KiB are held out by a hash of their bytes, so every file gives both splits."""
    big = _folder(tmp_path / "big", {f"part{i}.txt": _lines(f"p{i}", 60_000) for i in range(3)})
    cfg = _cfg(tmp_path, big, val_fraction=0.5)
    plan = plan_corpus(cfg)
    assert plan.mode == "pieces"
    corpus = load_corpus(cfg)
    for i in range(3):
        assert any(f"p{i} says" in t for t in corpus.train), i
        assert any(f"p{i} says" in t for t in corpus.valid), i
    held = sum(map(len, corpus.valid)) / sum(map(len, corpus.train + corpus.valid))
    assert 0.3 < held < 0.7
    # Every line of every file is in exactly one split, once, in order within a document.
    lines = sorted("".join(corpus.train + corpus.valid).splitlines())
    assert lines == sorted("".join(_lines(f"p{i}", 60_000) for i in range(3)).splitlines())


def test_many_documents_split_by_content(tmp_path: Path) -> None:
    files = {f"d{i:03d}.txt": _lines(f"d{i}", 3) for i in range(400)}
    files["copy.txt"] = files["d007.txt"]  # the same text, another name
    docs = _folder(tmp_path / "docs", files)
    cfg = _cfg(tmp_path, docs, val_fraction=0.1)
    assert plan_corpus(cfg).mode == "documents"
    corpus = load_corpus(cfg)
    assert len(corpus.train) + len(corpus.valid) == 401
    assert 15 < len(corpus.valid) < 70
    both = [corpus.train.count(files["d007.txt"]), corpus.valid.count(files["d007.txt"])]
    assert sorted(both) == [0, 2]  # duplicates land in one split
    (docs / "d100.txt").rename(docs / "renamed.txt")  # names do not choose the split
    renamed = load_corpus(cfg)
    assert sorted(renamed.valid) == sorted(corpus.valid)


def test_the_cap_keeps_the_first_megabytes(tmp_path: Path) -> None:
    stdlib = load_corpus(_cfg(tmp_path, None, corpus_mb=0.3))
    size = sum(len(d.encode()) for d in stdlib.train + stdlib.valid)
    assert 0.3e6 <= size <= 0.3e6 + 65536  # cut at a line end after the budget
    assert "standard library" in stdlib.source


# --- every input kind ------------------------------------------------------------------------
def _records(n: int) -> list[str]:
    return [f"record {i}: " + _lines(f"r{i}", 2) for i in range(n)]


def test_every_input_kind_gives_the_same_documents(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _records(40)
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    parquet = tmp_path / "records.bin"  # recognised by its content, not its suffix
    pq.write_table(pa.table({"text": texts, "n": list(range(40))}), parquet, row_group_size=7)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    csv = tmp_path / "records.csv"
    datasets.Dataset.from_dict({"text": texts}).to_csv(str(csv), index=False)
    mixed = _folder(tmp_path / "mixed", {"a.txt": texts[0], "b.data": jsonl.read_text()})
    expected = sorted(texts)
    for data in (jsonl, parquet, saved, f"csv:{csv}"):
        corpus = load_corpus(_cfg(tmp_path, data, val_fraction=0.1))
        assert sorted(corpus.train + corpus.valid) == expected, data
        assert len(corpus.valid) == 4, data  # the last 10% of 40 records
    both = load_corpus(_cfg(tmp_path, mixed, val_fraction=0.1))
    assert sorted(both.train + both.valid) == sorted([texts[0], *texts])
    with pytest.raises(ConfigError, match=r"'cvs' is not a datasets builder for local files"):
        load_corpus(_cfg(tmp_path, f"cvs:{csv}"))


def test_a_datasets_dict_keeps_its_validation_split(tmp_path: Path) -> None:
    import datasets

    saved = tmp_path / "dict"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": _records(6)}),
        "validation": datasets.Dataset.from_dict({"body": ["held " + _lines("v", 3)]}),
    }).save_to_disk(str(saved))  # fmt: skip
    corpus = load_corpus(_cfg(tmp_path, saved, text_field="body"))
    assert (sorted(corpus.train), corpus.valid) == (sorted(_records(6)), ["held " + _lines("v", 3)])


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.jsonl", '{"body": "x"}\n', r"without the field 'text' \(text_field\); its first "
         r"record's keys: \['body'\]"),
        ("b.jsonl", '{"text": "x"}\n{"text": null}\n', r"has no text in 'text'"),
        ("c.jsonl", '{"text": "x"}\nnot json\n', r"is not JSON"),
    ],
)  # fmt: skip
def test_bad_records_are_refused(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content * 30)
    with pytest.raises(ConfigError, match=message):
        load_corpus(_cfg(tmp_path, path))


def test_bad_columns_are_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a", "b"]}), path)
    with pytest.raises(ConfigError, match=r"has no column 'text' \(text_field\); its columns"):
        load_corpus(_cfg(tmp_path, path))
    pq.write_table(pa.table({"text": ["a", None, "b"] * 20}), path)
    with pytest.raises(ConfigError, match=r"row 1 has no text in 'text' \(null\)"):
        load_corpus(_cfg(tmp_path, path))


# --- shards ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE (trained once): the shard tests then skip tokenizer training."""
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer([_lines("tok", 3000)], 300).save_pretrained(str(folder))
    return folder


def _decoded(tokenizer: Any, ids: np.ndarray) -> str:
    return tokenizer.decode(ids.tolist())


def test_shards_hold_the_split_documents_each_ended_by_eos(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    docs = _folder(tmp_path / "docs", {f"d{i:03d}.txt": _lines(f"d{i}", 30) for i in range(300)})
    one = _cfg(tmp_path, docs, tokenizer=str(tokenizer_dir), val_fraction=0.2, name="one")
    tokenizer, train, _valid = prepare_data(one, build=True, workers=1)
    shards = TokenShards(Path(json.loads((one.run_dir / "data" / "meta.json").read_text())
                              ["shards_dir"]))  # fmt: skip
    corpus = load_corpus(one)
    assert shards.dtype == np.dtype("<u2")  # vocabulary 300
    for split, documents in (("train", corpus.train), ("valid", corpus.valid)):
        ids = np.asarray(shards.tokens(split))
        ends = np.asarray(shards.document_ends(split)).astype(np.int64)
        assert len(ends) == len(documents)
        assert (ids[ends - 1] == tokenizer.eos_token_id).all()
        assert _decoded(tokenizer, ids) == "".join(d + EOS for d in documents)  # lossless
    assert torch.equal(train[3], torch.from_numpy(shards.tokens("train")[48:64].astype(np.int64)))
    # Two workers write the same bytes (a second cache: nothing shared with the first).
    os.environ["NXD_TRAIN_CACHE"] = str(tmp_path / "other-cache")
    try:
        prepare_data(TrainConfig(**{**one.to_dict(), "name": "two"}), build=True, workers=2)
    finally:
        del os.environ["NXD_TRAIN_CACHE"]
    other = next((tmp_path / "other-cache" / "tokens").glob("*/meta.json")).parent
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (other / name).read_bytes() == (shards.folder / name).read_bytes(), name


def test_runs_share_shards_by_content(tmp_path: Path, tokenizer_dir: Path) -> None:
    text = _lines("shared", 2000)
    a, b = tmp_path / "a.txt", tmp_path / "elsewhere" / "b.txt"
    b.parent.mkdir()
    a.write_text(text)
    b.write_text(text)  # the same content at another path
    calls: list[int] = []
    first = _cfg(tmp_path, a, tokenizer=str(tokenizer_dir), name="first")
    prepare_data(first, build=True, workers=1)
    import nxd_trainer.train.shards as shards_module

    original = shards_module.build_shards

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    shards_module.build_shards = counting
    try:
        second = _cfg(tmp_path, b, tokenizer=str(tokenizer_dir), name="second", seq_len=32)
        _, train, _ = prepare_data(second, build=True, workers=1)
    finally:
        shards_module.build_shards = original
    assert calls == []  # found, not made again
    meta = [json.loads((c.run_dir / "data" / "meta.json").read_text()) for c in (first, second)]
    assert meta[0]["shards"] == meta[1]["shards"]
    assert train.seq_len == 32  # blocks are cut when read: one set of shards for every seq_len


def test_an_interrupted_preparation_resumes_to_the_same_shards(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nxd_trainer.train.corpus as corpus_module
    from nxd_trainer.train.data import load_tokenizer

    monkeypatch.setattr(corpus_module, "TASK", 1 << 17)  # 128 KiB tasks: a small corpus
    corpus = _folder(tmp_path / "c", {f"f{i}.txt": _lines(f"f{i}", 6_000) for i in range(4)})
    cfg = _cfg(tmp_path, corpus)
    plan = plan_corpus(cfg)
    assert len(plan.tasks) >= 5
    tokenizer = load_tokenizer(tokenizer_dir)
    args = (plan, tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, len(tokenizer))
    whole = build_shards(*args, tmp_path / "whole", workers=1, progress=False)

    def stop_after_one(index: int) -> None:
        if index == 1:
            raise KeyboardInterrupt

    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        build_shards(*args, cut, workers=1, progress=False, on_task=stop_after_one)
    progress = json.loads((tmp_path / "cut.partial" / "progress.json").read_text())
    assert progress["done"] == 2
    with (tmp_path / "cut.partial" / "train.bin").open("ab") as handle:
        handle.write(b"\x07" * 999)  # what a killed process appended after its last record
    resumed: list[int] = []
    build_shards(*args, cut, workers=2, progress=False, on_task=resumed.append)
    assert resumed == list(range(2, len(plan.tasks)))  # the done tasks were not redone
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx", "meta.json"):
        assert (cut / name).read_bytes() == (whole / name).read_bytes(), name
    assert not (tmp_path / "cut.partial").exists()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
def test_a_killed_prepare_command_resumes_to_the_same_shards(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """``nxd-train prepare`` SIGKILLed (with its workers) after two tasks, then rerun (CI runs
    the in-process interruption above)."""
    corpus = _folder(tmp_path / "c", {f"f{i}.txt": _lines(f"f{i}", 40_000) for i in range(4)})
    args = ["prepare", "--data", str(corpus), "--tokenizer", str(tokenizer_dir), "--seq-len",
            "16", "--no-progress", "--workers", "2"]  # fmt: skip
    command = [sys.executable, "-m", "nxd_trainer.train", *args]
    killed = subprocess.Popen(
        [*command, "--runs-dir", str(tmp_path / "runs")], env=_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    tokens = tmp_path / "runs" / ".cache" / "tokens"
    deadline = time.monotonic() + 300
    done = 0
    while done < 2 and time.monotonic() < deadline and killed.poll() is None:
        for progress in tokens.glob("*.partial/progress.json"):
            with contextlib.suppress(OSError, ValueError):
                done = json.loads(progress.read_text())["done"]
        time.sleep(0.01)
    os.killpg(killed.pid, signal.SIGKILL)  # the command and its workers at once
    killed.wait()
    assert done >= 2, killed.stderr.read() if killed.stderr else ""
    partial = next(tokens.glob("*.partial"))
    again = subprocess.run([*command, "--runs-dir", str(tmp_path / "runs")], env=_env(),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "prepared" in again.stderr
    assert not partial.exists()
    fresh = subprocess.run([*command, "--runs-dir", str(tmp_path / "fresh")], env=_env(),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr
    (made,) = [p for p in tokens.iterdir() if p.is_dir()]
    (whole,) = [p for p in (tmp_path / "fresh" / ".cache" / "tokens").iterdir() if p.is_dir()]
    assert made.name == whole.name
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx", "meta.json"):
        assert (made / name).read_bytes() == (whole / name).read_bytes(), name


# --- memory ----------------------------------------------------------------------------------
def _word_tokenizer() -> tuple[str, int, int]:
    """A word-level tokenizer (fast to run): JSON, EOS id, vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS: 0, "[UNK]": 1, **{f"w{i}": 2 + i for i in range(64)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer.to_str(), 0, len(vocab)


def test_preparation_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """Python's peak allocations while tokenizing 2 MB and 8 MB (one worker, in this process:
    what the main process and a worker each hold): the same, within one task's worth."""
    import tracemalloc

    words = " ".join(f"w{i % 64}" for i in range(2_000)) + "\n"  # 8.4 kB
    peaks = []
    for mb in (2, 8):
        corpus = _folder(tmp_path / f"c{mb}", {f"f{i}.txt": words * 12 for i in range(mb * 10)})
        plan = plan_corpus(_cfg(tmp_path, corpus))
        tracemalloc.start()
        build_shards(plan, *_word_tokenizer(), tmp_path / f"s{mb}", workers=1, progress=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        total = TokenShards(tmp_path / f"s{mb}").meta["tokens"]
        assert total["train"] + total["valid"] > mb * 200_000  # the corpus was tokenized
    assert peaks[1] < peaks[0] + (2 << 20), peaks  # 4x the corpus, not 4x the memory


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_the_loader_reads_only_its_rows(tmp_path: Path) -> None:
    """256 MB of token ids (a sparse file): 200 steps read 4 rows each and the process keeps
    none of the file (no mapping; each row is copied on demand), and the order needs no
    table (a loader over 10^12 blocks starts at once)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    n = 128 << 20  # uint16 ids
    with (folder / "train.bin").open("wb") as handle:
        handle.truncate(2 * n)
    for name in ("valid.bin", "train.idx", "valid.idx"):
        (folder / name).write_bytes(b"")
    (folder / "meta.json").write_text(json.dumps({
        "format": 1, "dtype": "<u2", "tokens": {"train": n, "valid": 0},
        "documents": {"train": 0, "valid": 0},
    }))  # fmt: skip
    blocks = TokenShards(folder).blocks("train", 128)
    loader = PackedLoader(blocks, 8, 1, 2, seed=3)
    loader.next_batch()
    before = _rss_kb()
    for _ in range(200):
        assert loader.next_batch().shape == (4, 128)
    assert str(folder / "train.bin") not in Path("/proc/self/maps").read_text()
    assert _rss_kb() - before < 4096  # 200 x 4 rows of 256 bytes were read and let go
    huge = PackedLoader(_Huge(), 8, 0, 1, seed=3)
    rows = huge.rows(5 * 10**12 - 3, 8)  # across an epoch boundary
    assert ((rows >= 0) & (rows < 10**12)).all()


class _Huge:
    def __len__(self) -> int:
        return 10**12


def test_the_order_is_a_permutation_per_epoch() -> None:
    from nxd_trainer.train.data import permute

    for n in (1, 2, 3, 7, 64, 1000, 4097):
        for epoch in (0, 1):
            order = permute(np.arange(n), n, 11, epoch)
            assert sorted(order.tolist()) == list(range(n))
    first, second = (permute(np.arange(1000), 1000, 11, e) for e in (0, 1))
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, np.arange(1000))


# --- refusals ----------------------------------------------------------------------------------
def test_old_run_folders_and_other_data_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, None, corpus_mb=0.1)
    (cfg.run_dir / "data").mkdir(parents=True)
    (cfg.run_dir / "data" / "blocks.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"holds data packed by an earlier nxd-train"):
        prepare_data(cfg, build=True)
    blocks = Blocks(np.arange(64, dtype=np.uint16), 8, "abc/train")
    loader = PackedLoader(blocks, 2, 0, 1, seed=1)
    state = loader.state_dict()
    with pytest.raises(ConfigError, match=r"saved by an earlier nxd-train"):
        loader.load_state_dict({k: v for k, v in state.items() if k != "order"})
    other = PackedLoader(Blocks(np.arange(64, dtype=np.uint16), 8, "xyz/train"), 2, 0, 1, 1)
    with pytest.raises(ConfigError, match=r"the corpus or tokenizer changed"):
        other.load_state_dict(state)


def test_prepare_command_then_the_run_finds_its_data(tmp_path: Path, tokenizer_dir: Path,
                                                     capsys: Any) -> None:  # fmt: skip
    from nxd_trainer.train import main

    text = tmp_path / "t.txt"
    text.write_text(_lines("t", 3000))
    flags = ["--data", str(text), "--tokenizer", str(tokenizer_dir), "--seq-len", "16",
             "--runs-dir", str(tmp_path / "runs"), "--no-progress"]  # fmt: skip
    assert main(["prepare", *flags]) == 0
    assert "nxd-train: prepared" in capsys.readouterr().err
    from nxd_trainer.train import parse_config

    _, train, valid = prepare_data(parse_config(flags), build=False)
    assert len(train) > 10 * len(valid) > 0
    assert main(["prepare", "--workers", "0", *flags]) == 2
    assert "--workers must be an integer >= 1" in capsys.readouterr().err
