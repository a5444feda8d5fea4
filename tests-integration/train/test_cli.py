"""``nxd-train``'s command line without training: ``--dry-run`` output on a TP=2 x PP=2 case,
and bad input ending in one clear line and a non-zero status, never a traceback (the five
cases of the issue, in process, and one through the real command)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nxd_state.testing import load_sibling

R = load_sibling(__file__, "_run")


def test_dry_run_prints_the_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nxd_trainer.train import main

    args = ["--dry-run", "--tp", "2", "--pp", "2", "--nproc-per-node", "8", "--microbatches", "2"]
    assert main([*args, "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "world 8; tp=2 pp=2 dp=2" in out
    table = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d,]+)$", out, re.M)
    # NxD's [PP, DP, TP] mesh, TP innermost: rank = pp*4 + dp*2 + tp.
    coords = [(int(r), int(p), int(d), int(t)) for r, _, p, d, t, _ in table]
    assert coords == [(r, r // 4, (r // 2) % 2, r % 2) for r in range(8)]
    total = int(re.search(r"; ([\d,]+) parameters", out).group(1).replace(",", ""))
    per_rank = {int(p): int(n.replace(",", "")) for _, _, p, _, _, n in table}
    # A stage's TP pair holds its stage's sharded weights once (2 KV heads: no K/V replication
    # at TP=2) and its RMSNorm weights twice: 4 layers x 2 norms + the final one, hidden 128.
    norms = (4 * 2 + 1) * 128
    assert 2 * (per_rank[0] + per_rank[1]) == total + norms
    assert "1f1b p=2 m=2" in out
    assert re.search(r"^rank 0: 0F0 0F1", out, re.M)
    assert re.search(r"^rank 1: +\. 1F0 1B0", out, re.M)


def test_dry_run_of_a_plan_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-NeoX (parallelised by transformers' plan, its stack at ``gpt_neox.layers``): each
    stage's TP pair holds its sharded weights once, and twice what TP keeps whole: the
    LayerNorms (weight and bias) and the row-parallel layers' biases."""
    from transformers import GPTNeoXConfig

    from nxd_trainer.train import main

    config = GPTNeoXConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "neox")
    model = str(tmp_path / "neox" / "config.json")
    args = ["--dry-run", "--model", model, "--tp", "2", "--pp", "2", "--nproc-per-node", "4",
            "--microbatches", "2", "--vocab-size", "384"]  # fmt: skip
    assert main([*args, "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    total = int(re.search(r"; ([\d,]+) parameters", out).group(1).replace(",", ""))
    table = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d,]+)$", out, re.M)
    per_rank = {int(p): int(n.replace(",", "")) for _, _, p, _, _, n in table}
    norms = (4 * 2 + 1) * 2 * 64  # 2 LayerNorms per layer and the final one
    row_biases = 4 * 2 * 64  # attention.dense and mlp.dense_4h_to_h
    assert 2 * (per_rank[0] + per_rank[1]) == total + norms + row_biases
    # A family with no plan (GPT-2) is refused naming it, by the check the launcher runs
    # before any write (cli._launcher: hf_config).
    from transformers import GPT2Config

    from nxd_trainer.train.config import ConfigError, TrainConfig
    from nxd_trainer.train.model import hf_config

    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=384).save_pretrained(tmp_path / "gpt2")
    gpt2 = TrainConfig(model=str(tmp_path / "gpt2" / "config.json"), vocab_size=384)
    with pytest.raises(ConfigError, match=r"model type 'gpt2'.*no tensor-parallel plan"):
        hf_config(gpt2, 1)


def test_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [*R.TINY, "--runs-dir", str(tmp_path)]
    missing = tmp_path / "nowhere"
    line = R.refusal([*base, "--data", str(missing)], capsys)
    assert f"data path '{missing}' does not exist" in line
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "blank.txt").write_text("  \n")
    assert "has no text" in R.refusal([*base, "--name", "e", "--data", str(empty)], capsys)
    assert "tp(3) x pp(1) = 3 does not divide the world size 2" in R.refusal(
        [*base, "--tp", "3"], capsys
    )
    # The model against the degrees, before the data is prepared (nothing written).
    heads = [*base, "--name", "heads", "--tp", "3", "--nproc-per-node", "3"]
    assert "tp(3) does not divide the model's 4 attention heads" in R.refusal(heads, capsys)
    assert not (tmp_path / "heads").exists()
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert "holds no weights" in R.refusal([*base, "--model", str(folder)], capsys)
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 3\nseq_lenn = 64\n")
    message = R.refusal([*base, "--config", str(toml)], capsys)
    assert "unknown config key 'seq_lenn' (did you mean 'seq_len'?)" in message
    toml.write_text("[optimization]\nsteps = 'long'\n")  # tables are flattened
    assert "steps must be an integer >= 1, got 'long'" in R.refusal(
        [*base, "--config", str(toml)], capsys
    )


def test_bad_input_through_the_command(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("zero_1 = true\n")
    done = R.nxd_train(["--config", str(toml)], tmp_path, check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "nxd-train: error: unknown config key 'zero_1' (did you mean 'zero1'?); run "
        "`nxd-train --help` for the valid keys"
    )


def test_help_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import fields

    from nxd_trainer.train import TrainConfig, main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for f in fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in out
    assert "Tensor-parallel degree" in out  # the field's docstring is its help


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # an abbreviation is refused (argparse would take --step as --steps)
        (["--step", "5"], "unrecognized argument '--step' (did you mean '--steps'?)"),
        (["--stpes", "5"], "unrecognized argument '--stpes' (did you mean '--steps'?)"),
        (["--zero-1"], "unrecognized argument '--zero-1' (did you mean '--zero1'?)"),
        (["--schedule", "interleaved_1f1b"], "invalid choice: 'interleaved_1f1b'"),
        (["--tp", "two"], "argument --tp: invalid int value: 'two'"),
    ],
)
def test_flag_errors_are_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = R.refusal([*argv, "--runs-dir", str(tmp_path)], capsys)
    assert message in line
    assert "usage:" not in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


def test_help_is_plain_text_with_accepted_values_only(capsys: pytest.CaptureFixture[str]) -> None:
    from nxd_trainer.train import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "`" not in out  # the docstrings' markup is gone
    assert "interleaved_1f1b" not in out  # nxd-train refuses it: not offered
    assert "{gpipe,1f1b,zb_h1}" in out
    assert "{none,full,selective}" in out


def test_a_disk_error_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only or full disk (simulated: these tests run as root, which ignores modes)."""
    import errno

    from nxd_trainer.train import main
    from nxd_trainer.train.rundir import RunDir

    def refuse(self: RunDir) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self.root))

    monkeypatch.setattr(RunDir, "lock", refuse)
    assert main([*R.TINY, "--runs-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        err.strip() == f"nxd-train: error: [Errno 30] Read-only file system: '{tmp_path / 'tiny'}'"
    )
