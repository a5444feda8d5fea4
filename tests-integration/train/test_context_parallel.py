"""``nxd-train --cp 2``: the tiny model with every sequence split over two ranks follows the
one-process reference (``_run.py``) step by step, with ring attention (TP=1 x CP=2) and
all-to-all attention (``-m slow``); LoRA at CP=2 equals LoRA at CP=1 (``-m slow``); a run saved
at CP=2 resumes at CP=1 (checkpoints do not depend on CP), and TP=2 x CP=2 with ZeRO-1 on 4
ranks then TP=2 x DP=1 (``-m slow``). The flags, their TOML keys, ``--dry-run``'s CP column and
the refusals, without training.

Tolerances as in ``test_train.py``: rtol 1e-4 / atol 1e-5 on losses (fp32; CP re-associates
the attention's softmax sums, merged block by block, and the loss sum over ranks: ~1e-7
relative per op, amplified by AdamW's normalised update over the steps). A wrong split,
position, mask or loss weighting moves the first loss by 1e-2 or more.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from nxd_state.testing import load_sibling

R = load_sibling(__file__, "_run")
TOL = {"rtol": 1e-4, "atol": 1e-5}
QUICK = ["--no-export", "--eval-every", "0"]


def test_cp_flags_dry_run_and_bad_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--cp / --cp-algorithm (and their TOML keys): the layout, and every refusal in one line
    before anything is written."""
    from nxd_trainer.train import main

    base = [*R.TINY, "--runs-dir", str(tmp_path)]
    toml = tmp_path / "cp.toml"
    toml.write_text('tp = 1\ncp = 2\ncp_algorithm = "all-to-all"\n')
    assert main([*base, "--dry-run", "--config", str(toml), "--nproc-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "world 8; tp=1 pp=1 cp=2 (all-to-all) dp=4" in out
    assert "16 tokens of each on a CP rank" in out
    # [PP, DP, CP, TP], TP innermost: rank = dp*2 + cp (tp = 1).
    table = re.findall(r"^\s+(\d+)\s+\d+\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d,]+$", out, re.M)
    coords = [tuple(int(x) for x in row) for row in table]
    assert coords == [(r, 0, r // 2, r % 2, 0) for r in range(8)]
    cases = {
        "seq_len 30 is not divisible by 2 x cp(2) = 4 (the ring's zigzag split)": [
            "--cp", "2", "--seq-len", "30"],
        "seq_len 30 is not divisible by cp(4)": [
            "--cp", "4", "--cp-algorithm", "all-to-all", "--seq-len", "30"],
        "tp(2) x pp(1) x cp(2) = 4 does not divide the world size 2": ["--cp", "2"],
        "cp=2 with compile=True is not supported yet": ["--cp", "2", "--compile"],
        "the model has 1 key/value heads per tensor-parallel rank (tp=2)": [
            "--cp", "2", "--cp-algorithm", "all-to-all", "--nproc-per-node", "4"],
        "argument --cp-algorithm: invalid choice: 'ulysses'": ["--cp-algorithm", "ulysses"],
    }  # fmt: skip
    for expected, flags in cases.items():
        assert expected in R.refusal([*base, "--name", "bad", *flags], capsys), flags
    assert not (tmp_path / "bad").exists()


def _check(run: Path, steps: list[int], plan: list[tuple[int, list[str]]]) -> None:
    got = R.losses(run)
    ref = R.reference(run, [], plan)
    assert sorted(got) == sorted(ref["losses"])
    torch.testing.assert_close(
        torch.tensor([got[s] for s in steps]),
        torch.tensor([ref["losses"][s] for s in steps]),
        **TOL,
    )


def test_cp2_ring_matches_one_process_and_resumes_at_cp1(tmp_path: Path) -> None:
    first = ["--steps", "2", "--save-every", "2"]
    cp2 = ["--tp", "1", "--cp", "2", "--nproc-per-node", "2"]
    done = R.nxd_train([*R.TINY, *QUICK, *first, *cp2, "--runs-dir", str(tmp_path)], tmp_path)
    assert "tp=1 pp=1 cp=2 (ring) dp=1" in done.stderr
    run = tmp_path / "tiny"
    _check(run, [1, 2], [(2, first)])
    # The same run folder continued at CP=1 on one process: the CP=2 checkpoint loads as is.
    more = ["--steps", "3", "--tp", "1", "--nproc-per-node", "1"]
    R.nxd_train([*R.TINY, *QUICK, *more, "--runs-dir", str(tmp_path)], tmp_path)
    _check(run, [1, 2, 3], [(2, first), (3, ["--steps", "3"])])


@pytest.mark.slow  # the algorithm's parity: packages/nxd-trainer/tests/test_context_parallel.py
def test_cp2_all_to_all_matches_one_process(tmp_path: Path) -> None:
    args = ["--steps", "2", "--tp", "1", "--cp", "2", "--cp-algorithm", "all-to-all",
            "--nproc-per-node", "2", "--eval-every", "2"]  # fmt: skip
    R.nxd_train([*R.TINY, "--no-export", *args, "--runs-dir", str(tmp_path)], tmp_path)
    run = tmp_path / "tiny"
    _check(run, [1, 2], [(2, args)])
    assert [r["step"] for r in R.rows(run, "eval")] == [2]  # the validation pass runs at CP=2


@pytest.mark.slow
def test_tp2_cp2_zero1_on_four_ranks_then_cp1(tmp_path: Path) -> None:
    first = ["--steps", "2", "--save-every", "2"]
    layout = ["--tp", "2", "--cp", "2", "--zero1", "--nproc-per-node", "4"]
    R.nxd_train([*R.TINY, *QUICK, *first, *layout, "--runs-dir", str(tmp_path)], tmp_path)
    run = tmp_path / "tiny"
    _check(run, [1, 2], [(2, first)])
    shutil.copytree(run, tmp_path / "copy")  # keep the CP=2 folder for a look on failure
    more = ["--steps", "3", "--tp", "2", "--zero1", "--nproc-per-node", "2"]
    R.nxd_train([*R.TINY, *QUICK, *more, "--runs-dir", str(tmp_path)], tmp_path)
    _check(run, [1, 2, 3], [(2, first), (3, ["--steps", "3"])])


@pytest.mark.slow  # the parity of LoRA x CP: packages/nxd-trainer/tests/test_context_parallel.py
def test_cp2_lora_equals_cp1_lora(tmp_path: Path) -> None:
    lora = [*R.TINY, *QUICK, "--steps", "2", "--tp", "1", "--lora-rank", "4"]
    runs = {"cp2": ["--cp", "2", "--nproc-per-node", "2"], "cp1": ["--nproc-per-node", "1"]}
    for name, flags in runs.items():
        R.nxd_train([*lora, *flags, "--name", name, "--runs-dir", str(tmp_path)], tmp_path)
    got, want = R.losses(tmp_path / "cp2"), R.losses(tmp_path / "cp1")
    assert sorted(got) == sorted(want) == [1, 2]
    torch.testing.assert_close(
        torch.tensor([got[s] for s in (1, 2)]), torch.tensor([want[s] for s in (1, 2)]), **TOL
    )


@pytest.mark.slow  # the parity of CP x PP: packages/nxd-trainer/tests/test_pipeline_combos.py
def test_cp2_pp2_matches_one_process(tmp_path: Path) -> None:
    """CP2 x PP2 on 4 ranks, 2 micro-batches: the stages pass each CP rank's slice."""
    args = ["--steps", "2", "--tp", "1", "--cp", "2", "--pp", "2", "--microbatches", "2",
            "--nproc-per-node", "4"]  # fmt: skip
    done = R.nxd_train([*R.TINY, *QUICK, *args, "--runs-dir", str(tmp_path)], tmp_path)
    assert "tp=1 pp=2 cp=2 (ring) dp=1" in done.stderr
    _check(tmp_path / "tiny", [1, 2], [(2, args)])
