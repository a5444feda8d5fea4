"""``nxd-train`` saves its checkpoints in the background by default (``async_save``;
``--no-async-save`` writes them before training continues), and nothing changes but when
the loop waits:

* the same tiny run with async and with sync saves writes bitwise the same tensors for every
  tag and the same losses, while a fault makes the background copy of the parameters and
  optimizer state slow, so the step after each save has to wait for it (the log says so);
  ``--keep 2`` leaves exactly the newest 2 complete tags, each with one data folder;
* both runs resumed to more steps continue bitwise alike (a resume from an async tag is a
  resume from the sync one);
* a background write that fails on one rank (ENOSPC from the writer) ends the job at the next
  save or at the end of the run, exit 1, one line per rank naming the tag, no traceback; the
  previous complete tag is intact and is where a rerun resumes.

The faults are installed in the workers through ``_save_faults.py`` (a ``sitecustomize``).
Ctrl-C while a save is in flight: ``test_interrupt.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from nxd_state.testing import load_sibling

R = load_sibling(__file__, "_run")
# A save every step, the newest two kept; no export or evaluation (they add nothing here).
SAVES = ["--save-every", "1", "--keep", "2", "--eval-every", "0", "--no-export"]
SLOW_COPY_S = 0.5  # longer than a tiny step's forward and backward on 2 loaded cores


def tensors(ckpt: Path) -> dict[str, bytes]:
    """Every tensor of every complete tag, as its bytes, keyed by tag, file and tensor key."""
    from safetensors import safe_open

    out = {}
    for tag in sorted(p for p in ckpt.iterdir() if (p / "done").is_file()):
        for file in sorted(tag.glob("data-*/*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    value = handle.get_tensor(key).contiguous().view(-1).view(torch.uint8)
                    out[f"{tag.name}/{file.name}/{key}"] = value.numpy().tobytes()
    return out


def assert_same_tensors(ckpt: Path, reference: Path) -> None:
    got, want = tensors(ckpt), tensors(reference)
    assert got.keys() == want.keys()
    assert len(got) > 0
    for key, value in got.items():
        assert value == want[key], key


def folders(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def blocked_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "the loop was blocked" in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def pair(runs: Path) -> dict[str, str]:
    """The same 5 steps saved asynchronously (with the slow copy) and synchronously."""
    out = {}
    for name, flags, extra in (
        ("async", [], R.fault_env(runs, f"slow_copy:{SLOW_COPY_S}")),
        ("sync", ["--no-async-save"], None),
    ):
        args = [*R.TINY, *SAVES, "--steps", "5", *flags, "--runs-dir", str(runs), "--name", name]
        done = R.nxd_train(args, runs, extra_env=extra)
        out[name] = done.stdout + done.stderr
    return out


def test_async_tags_are_bitwise_the_sync_ones(runs: Path, pair: dict[str, str]) -> None:
    asynchronous, synchronous = runs / "async" / "checkpoints", runs / "sync" / "checkpoints"
    # --keep 2: exactly the newest two tags, complete, nothing else left behind.
    assert folders(asynchronous) == folders(synchronous) == ["step_00000004", "step_00000005"]
    for tag in folders(asynchronous):
        assert (asynchronous / tag / "done").is_file()
        assert len(list((asynchronous / tag).glob("data-*"))) == 1
    assert_same_tensors(asynchronous, synchronous)
    assert R.losses(runs / "async") == R.losses(runs / "sync")  # bitwise, every step
    # One line per save. Async: the step after each save waited for the slowed copy (the
    # last save's wait is the end of the run's wait for its write); sync: the call alone.
    lines = blocked_lines(pair["async"])
    assert [line.split(":")[0] for line in lines] == [
        f"checkpoint step_{s:08d}" for s in range(1, 6)
    ], pair["async"]
    assert all("async_copy=before_step" in line for line in lines)
    waits = [float(re.search(r"then waited ([0-9.]+) s", line)[1]) for line in lines]  # type: ignore[index]
    assert max(waits[:-1]) > SLOW_COPY_S / 5, lines
    assert "the step after a save waits for its copy to host memory" in pair["async"]
    sync_lines = blocked_lines(pair["sync"])
    assert len(sync_lines) == 5
    assert all(": saved, the loop" in line for line in sync_lines)
    assert "checkpoints: written before training continues" in pair["sync"]
    assert "Traceback" not in pair["async"] + pair["sync"]


def test_resume_from_an_async_tag_continues_like_a_sync_one(
    runs: Path, pair: dict[str, str]
) -> None:
    for name, flags in (("async", []), ("sync", ["--no-async-save"])):
        args = [*R.TINY, *SAVES, "--steps", "7", *flags, "--runs-dir", str(runs), "--name", name]
        done = R.nxd_train(args, runs)
        assert "(step 5)" in done.stderr  # resumed from step_00000005
    assert sorted(R.losses(runs / "async")) == list(range(1, 8))
    assert R.losses(runs / "async") == R.losses(runs / "sync")  # bitwise, steps 6 and 7 too
    asynchronous, synchronous = runs / "async" / "checkpoints", runs / "sync" / "checkpoints"
    assert folders(asynchronous) == folders(synchronous) == ["step_00000006", "step_00000007"]
    assert_same_tensors(asynchronous, synchronous)


@pytest.mark.parametrize(("where", "steps"), [("at the next save", 6), ("at the end", 4)])
def test_a_failed_background_write_ends_the_run_naming_its_tag(
    tmp_path: Path, where: str, steps: int
) -> None:
    """Rank 1's write of step 4 fails (ENOSPC). Saves at steps 2, 4 (and 6): the failure is
    raised by the wait before the step-6 save, or by the wait at the end of the run."""
    import nxd_ckpt
    from nxd_trainer.train import RunDir

    args = [*R.TINY, "--save-every", "2", "--eval-every", "0", "--no-export",
            "--steps", str(steps), "--runs-dir", str(tmp_path)]  # fmt: skip
    env = R.fault_env(tmp_path, "fail_write:step_00000004:1")
    done = R.nxd_train(args, tmp_path, check=False, extra_env=env)
    ckpt = tmp_path / "tiny" / "checkpoints"
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    failed = f"checkpoint {ckpt / 'step_00000004'} was not saved: its background write failed"
    lines = [line for line in done.stderr.splitlines() if failed in line]
    assert len(lines) == 2, done.stderr  # one per rank: the failing one says why
    assert any("No space left on device" in line for line in lines), lines
    assert sorted(R.losses(tmp_path / "tiny")) == list(range(1, steps + 1))
    # The previous tag is intact and is the resume point; step 4 is not complete; no step 6.
    assert not (ckpt / "step_00000004" / "done").exists()
    assert not (ckpt / "step_00000006").exists()
    assert RunDir(tmp_path / "tiny").complete_tags() == ["step_00000002"]
    nxd_ckpt.verify_tag(ckpt, "step_00000002")
    point = RunDir(tmp_path / "tiny").resume_point(verify=True)
    assert point is not None
    assert point.step == 2
