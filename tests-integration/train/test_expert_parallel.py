"""``nxd-train --model tiny-moe --ep 2``: a tiny Mixtral whose experts are split over two ranks
follows the one-process reference (``_run.py``: the same model on the global batch) step by
step, resumes at EP=1 on one process (the checkpoint holds every expert in its global shape),
and exports a folder ``transformers`` loads, with the reference model's logits. The flag, its
TOML key, ``--dry-run``'s EP line and the refusals, without training.

Tolerances as in ``test_train.py``: rtol 1e-4 / atol 1e-5 on losses (fp32; EP only moves token
rows between ranks and sums each token's experts in the same order, so the products are the
same; the DP average and the expert-DP reduction re-associate sums: ~1e-7 relative, amplified
by AdamW's normalised update over the steps). Expert gradients averaged over the wrong group
or an expert applied on the wrong rank move the first losses by 1e-3 or more. The exported
logits: 1e-4 (three AdamW steps of that round-off).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxd_state.testing import load_sibling

R = load_sibling(__file__, "_run")
TOL = {"rtol": 1e-4, "atol": 1e-5}
MOE = ["--model", "tiny-moe", "--tp", "1"]


def test_ep_flag_dry_run_and_bad_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nxd_trainer.train import main

    base = [*R.TINY, "--runs-dir", str(tmp_path)]
    toml = tmp_path / "ep.toml"
    toml.write_text('model = "tiny-moe"\ntp = 1\nep = 2\n')
    assert main([*base, "--dry-run", "--config", str(toml), "--nproc-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "world 4; tp=1 pp=1 dp=4 ep=2 (expert-dp 2)" in out
    cases = {
        "ep(2) does not divide dp(3)": [*MOE, "--ep", "2", "--nproc-per-node", "3"],
        "ep(3) does not divide the model's 4 experts per layer": [
            *MOE, "--ep", "3", "--nproc-per-node", "3", "--batch-size", "6"],
        "ep=2 needs a mixture-of-experts model": ["--tp", "1", "--ep", "2"],
        "ep=2 with cp=2 is not supported yet": [*MOE, "--ep", "2", "--cp", "2"],
        "ep=2 with lora_rank=4 is not supported yet": [*MOE, "--ep", "2", "--lora-rank", "4"],
    }  # fmt: skip
    for expected, flags in cases.items():
        assert expected in R.refusal([*base, "--name", "bad", *flags], capsys), flags
    assert not (tmp_path / "bad").exists()


def test_ep2_matches_one_process_resumes_at_ep1_and_exports(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    first = ["--steps", "2", "--save-every", "2", "--no-export", "--eval-every", "0"]
    ep2 = ["--ep", "2", "--nproc-per-node", "2"]
    done = R.nxd_train([*R.TINY, *MOE, *first, *ep2, "--runs-dir", str(tmp_path)], tmp_path)
    assert "tp=1 pp=1 dp=2 ep=2" in done.stderr
    run = tmp_path / "tiny"
    got = R.losses(run)
    ref = R.reference(run, MOE, [(2, first)])
    assert sorted(got) == [1, 2]
    torch.testing.assert_close(
        torch.tensor([got[1], got[2]]), torch.tensor([ref["losses"][1], ref["losses"][2]]), **TOL
    )
    # The same run continued at EP=1 on one process, then exported.
    more = ["--steps", "3", "--nproc-per-node", "1", "--eval-every", "0"]
    R.nxd_train([*R.TINY, *MOE, *more, "--runs-dir", str(tmp_path)], tmp_path)
    got = R.losses(run)
    ref = R.reference(run, MOE, [(2, first), (3, ["--steps", "3"])])
    torch.testing.assert_close(
        torch.tensor([got[s] for s in (1, 2, 3)]),
        torch.tensor([ref["losses"][s] for s in (1, 2, 3)]),
        **TOL,
    )
    exported = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert type(exported).__name__ == "MixtralForCausalLM"
    ids = ref["valid"][:2].long()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, ref["model"](input_ids=ids).logits,
            rtol=1e-4, atol=1e-4,
        )  # fmt: skip


@pytest.mark.slow
def test_ep2_zero1_on_four_ranks_matches_one_process(tmp_path: Path) -> None:
    """ZeRO-1 at EP2 x DP4: expert state sharded over the 2 ranks holding the same experts."""
    args = ["--steps", "2", "--no-export", "--eval-every", "0", "--ep", "2", "--zero1",
            "--nproc-per-node", "4"]  # fmt: skip
    R.nxd_train([*R.TINY, *MOE, *args, "--runs-dir", str(tmp_path)], tmp_path)
    run = tmp_path / "tiny"
    got, ref = R.losses(run), R.reference(run, MOE, [(2, args)])["losses"]
    assert sorted(got) == [1, 2]
    torch.testing.assert_close(
        torch.tensor([got[1], got[2]]), torch.tensor([ref[1], ref[2]]), **TOL
    )


@pytest.mark.slow  # the parity of EP x PP: packages/nxd-trainer/tests/test_pipeline_combos.py
def test_ep2_pp2_matches_one_process(tmp_path: Path) -> None:
    """EP2 x PP2 on 4 ranks (DP2 = EP2): each stage holds its layers' experts over EP."""
    args = ["--steps", "2", "--no-export", "--eval-every", "0", "--ep", "2", "--pp", "2",
            "--nproc-per-node", "4"]  # fmt: skip
    done = R.nxd_train([*R.TINY, *MOE, *args, "--runs-dir", str(tmp_path)], tmp_path)
    assert "tp=1 pp=2 dp=2 ep=2" in done.stderr
    run = tmp_path / "tiny"
    got, ref = R.losses(run), R.reference(run, MOE, [(2, args)])["losses"]
    assert sorted(got) == [1, 2]
    torch.testing.assert_close(
        torch.tensor([got[1], got[2]]), torch.tensor([ref[1], ref[2]]), **TOL
    )
