"""nxd-train's run folder and data at their edges, without launching a job: a second process
on the same folder, a resume with other settings (refused before anything changes), a
finished run rerun (nothing changes), symlinked tags, small and odd corpora, strict JSON
metrics, the export's sampling settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nxd_trainer.train import ConfigError, TrainConfig, load_corpus
from nxd_trainer.train.rundir import RunDir, tag_name


def _checkpoint(run: RunDir, step: int, cfg: TrainConfig) -> None:
    """A tag as nxd-train writes it: a (tiny) model and the trainer's user content."""
    import nxd_ckpt

    user = {"step": step, "tokens": 0, "loader": {}, "config": cfg.to_dict()}
    nxd_ckpt.save_checkpoint(
        run.checkpoints, tag_name(step), model=torch.nn.Linear(2, 2), user_content=user
    )


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_a_second_process_on_the_run_folder_is_refused(tmp_path: Path) -> None:
    run = RunDir.of(TrainConfig(runs_dir=str(tmp_path)))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from filelock import FileLock; "
         f"lock = FileLock({str(run.root / '.lock')!r}); lock.acquire(); "
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    run.root.mkdir(parents=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=r"is in use by another nxd-train"), run.lock():
            pass
    finally:
        holder.kill()
        holder.wait()
    with run.lock():  # free again once the holder is gone
        pass


def test_resume_with_other_settings_is_refused_before_anything_changes(tmp_path: Path) -> None:
    cfg = TrainConfig(runs_dir=str(tmp_path), steps=4)
    run = RunDir.of(cfg)
    _checkpoint(run, 2, cfg)
    run.write_config()
    before = _snapshot(run.root)
    changed = RunDir.of(TrainConfig(runs_dir=str(tmp_path), steps=4, seq_len=64, batch_size=2))
    with pytest.raises(
        ConfigError, match=r"another setup \(seq_len: 128 -> 64, batch_size: 8 -> 2\)"
    ):
        changed.begin(changed.resume_point())
    assert _snapshot(run.root) == before
    # A command that continues the run (more steps, other degrees) records its settings.
    more = RunDir.of(TrainConfig(runs_dir=str(tmp_path), steps=6, tp=1, zero1=True))
    point = more.resume_point()
    assert point.step == 2
    more.begin(point)
    assert "steps = 6" in more.config_file.read_text()


def test_a_finished_run_rerun_changes_nothing(tmp_path: Path) -> None:
    cfg = TrainConfig(runs_dir=str(tmp_path), steps=2)
    run = RunDir.of(cfg)
    _checkpoint(run, 2, cfg)
    run.write_config()
    before = _snapshot(run.root)
    again = RunDir.of(TrainConfig(runs_dir=str(tmp_path), steps=2, tp=1))  # nothing to train
    point = again.resume_point()
    assert point.step == 2
    again.begin(point)
    assert _snapshot(run.root) == before


def test_a_tag_saved_by_another_tool_is_refused(tmp_path: Path) -> None:
    import nxd_ckpt

    run = RunDir.of(TrainConfig(runs_dir=str(tmp_path)))
    nxd_ckpt.save_checkpoint(run.checkpoints, tag_name(3), model=torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"step_00000003 was not saved by nxd-train"):
        run.resume_point()


def test_a_damaged_newest_tag_falls_back_to_the_previous_intact_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = TrainConfig(runs_dir=str(tmp_path))
    run = RunDir.of(cfg)
    for step in (2, 4):
        _checkpoint(run, step, cfg)
    data = next((run.checkpoints / tag_name(4)).rglob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in a tensor's bytes
    data.write_bytes(bytes(raw))
    assert run.resume_point().step == 2
    warning = capsys.readouterr().err
    assert f"nxd-train: warning: checkpoint {run.checkpoints / tag_name(4)} is damaged" in warning
    assert "skipping it" in warning
    (run.checkpoints / tag_name(2) / "index.json").write_text("[]")  # both damaged now
    with pytest.raises(ConfigError, match=r"every checkpoint of .* is damaged"):
        run.resume_point()


def test_symlinks_and_incomplete_tags_are_not_tags_of_the_run(tmp_path: Path) -> None:
    cfg = TrainConfig(runs_dir=str(tmp_path / "runs"))
    run = RunDir.of(cfg)
    _checkpoint(run, 2, cfg)
    outside = RunDir(tmp_path / "other")
    _checkpoint(outside, 9, cfg)
    (run.checkpoints / tag_name(9)).symlink_to(outside.checkpoints / tag_name(9))
    (run.checkpoints / tag_name(7)).mkdir()  # a save that never committed: no `done`
    assert run.complete_tags() == [tag_name(2)]
    assert run.resume_point().step == 2


def test_text_is_recognised_by_content_and_small_corpora_split(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    (notes / ".git").mkdir(parents=True)
    (notes / "todo.org").write_text("* TODO write the report\n" * 40)
    (notes / "server.log").write_text("GET /index.html 200\n" * 40)
    (notes / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 50)
    (notes / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    corpus = load_corpus(TrainConfig(data=str(notes), val_fraction=0.1))
    texts = corpus.train + corpus.valid
    assert corpus.train  # two documents: the last one is held out
    assert corpus.valid
    assert any("TODO" in t for t in texts)
    assert any("GET /index" in t for t in texts)
    assert not any("refs/heads" in t for t in texts)  # version-control folders are skipped
    one = tmp_path / "one.txt"
    one.write_text("".join(f"line {i}\n" for i in range(100)))
    single = load_corpus(TrainConfig(data=str(one), val_fraction=0.2))
    assert "".join(single.train + single.valid) == one.read_text()  # cut at a line end
    assert single.valid[0].startswith("line 80\n")
    assert load_corpus(TrainConfig(data=str(one), val_fraction=0.2)) == single
    # Three big files, as the issue had them (refused before): a small corpus holds out its
    # last 5%, inside the last file (no file boundary near the cut point).
    big = tmp_path / "big"
    big.mkdir()
    for i in range(3):
        (big / f"part{i}.txt").write_text("".join(f"{i} row {j}\n" for j in range(40_000)))
    split = load_corpus(TrainConfig(data=str(big), val_fraction=0.05, corpus_mb=0))
    assert [t[:6] for t in split.train] == ["0 row ", "1 row ", "2 row "]
    (held,) = split.valid
    assert held.startswith("2 row ")
    assert held.endswith("2 row 39999\n")
    assert 0.04 < len(held) / sum(map(len, split.train + split.valid)) < 0.06


def test_too_little_text_names_the_sequence_length_that_works(tmp_path: Path) -> None:
    from nxd_trainer.train.data import prepare_data

    text = tmp_path / "short.txt"
    text.write_text("".join(f"the quick brown fox {i}\n" for i in range(30)))
    runs = tmp_path / "runs"
    cfg = TrainConfig(data=str(text), runs_dir=str(runs), vocab_size=300, seq_len=512)
    with pytest.raises(ConfigError, match=r"use --seq-len (\d+) or less") as info:
        prepare_data(cfg, build=True)
    assert not (runs / "tiny" / "tokenizer").exists()  # nothing was written
    assert not (runs / "tiny" / "data" / "meta.json").exists()
    fits = int(info.value.args[0].split("--seq-len ")[1].split()[0])
    ok = TrainConfig(data=str(text), runs_dir=str(runs), vocab_size=300, seq_len=fits)
    _, train, valid = prepare_data(ok, build=True)
    assert len(train) >= 1
    assert len(valid) >= 1


def test_metrics_are_strict_json(tmp_path: Path) -> None:
    from nxd_trainer.train.metrics import Metrics

    metrics = Metrics(tmp_path, writer=True, steps=2, start=0, bar=False)
    metrics.train(1, float("nan"), 1e-3, float("inf"), 128, 10.0)
    metrics.eval(1, float("nan"))
    metrics.close()

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    rows = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl")
            .read_text().splitlines()]  # fmt: skip
    assert rows[0]["loss"] is None
    assert rows[0]["grad_norm"] is None
    assert rows[0]["lr"] == 1e-3
    assert rows[1]["val_loss"] is None
    assert rows[1]["val_perplexity"] is None


def test_the_export_samples_with_the_run_settings(tmp_path: Path) -> None:
    from nxd_trainer.train.export import run_settings

    cfg = TrainConfig(runs_dir=str(tmp_path), seed=77, prompt="import ", sample_tokens=5)
    RunDir.of(cfg).write_config()
    assert run_settings(cfg.run_dir) == {"seed": 77, "prompt": "import ", "sample_tokens": 5}
    defaults = TrainConfig()
    assert run_settings(tmp_path / "nowhere")["seed"] == defaults.seed
