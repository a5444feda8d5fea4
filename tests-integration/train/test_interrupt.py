"""Ctrl-C anywhere in ``nxd-train``: exit 130 within seconds, one line, nothing half written.

Ctrl-C in a terminal is SIGINT to the foreground process group: here the launcher is started
in a session of its own and the signal goes to its group (its workers run in sessions of
their own, as torch's elastic agent starts them: the agent forwards the signal). Four moments:

* while the modules load (the first second of the process);
* while the data is prepared (the tokenizer trained on a few MB, tokens packed): the run
  folder keeps no temporary file, no ``data/meta.json``, no ``config.toml``;
* while the workers start (imports, model build): no checkpoint, no traceback;
* while training: the step in flight finishes, is saved (``done`` marker) and the run resumes
  from it.

In each case stderr has exactly one line about it and no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nxd_state.testing import load_sibling

R = load_sibling(__file__, "_run")
STOP_WITHIN_S = 60.0  # on 2 loaded cores; the tiny step and save take well under a second


def _start(
    args: list[str], cwd: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        R.command(args), cwd=cwd, env={**R.env(), **(extra_env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _ctrl_c(job: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGINT to the launcher's process group, as a terminal's Ctrl-C; its output."""
    os.killpg(job.pid, signal.SIGINT)
    started = time.monotonic()
    out, err = job.communicate(timeout=R.TIMEOUT)
    assert time.monotonic() - started < STOP_WITHIN_S, err
    return out, err


def _wait_for(job: subprocess.Popen[str], done: object, what: str) -> None:
    deadline = time.monotonic() + R.TIMEOUT
    while not done():  # type: ignore[operator]
        assert job.poll() is None, f"nxd-train ended before {what}: {job.communicate()}"
        assert time.monotonic() < deadline, f"no {what} in {R.TIMEOUT} s"
        time.sleep(0.02)


def _check_one_line(code: int | None, err: str) -> str:
    assert code == 130, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("nxd-train: interrupted"), err
    return lines[0]


def _temporary_files(run: Path) -> list[Path]:
    return [p for p in run.rglob("*") if p.name.endswith((".tmp", ".old"))]


def test_ctrl_c_while_modules_load(tmp_path: Path) -> None:
    job = _start([*R.TINY, "--runs-dir", str(tmp_path)], tmp_path)
    time.sleep(1.0)  # the interpreter is up; torch and the model code are still loading
    _, err = _ctrl_c(job)
    _check_one_line(job.returncode, err)
    assert not (tmp_path / "tiny").exists()  # nothing was written


def test_ctrl_c_while_preparing_data(tmp_path: Path) -> None:
    # A few MB of text: the BPE training and the packing take seconds, not milliseconds.
    args = [*R.TINY, "--corpus-mb", "6", "--vocab-size", "2048", "--runs-dir", str(tmp_path)]
    job = _start(args, tmp_path)
    run = tmp_path / "tiny"
    _wait_for(job, lambda: (run / ".prepare.lock").exists(), "data preparation")
    time.sleep(0.5)
    _, err = _ctrl_c(job)
    _check_one_line(job.returncode, err)
    if run.exists():
        assert _temporary_files(run) == []
        assert not (run / "data" / "meta.json").exists()
        assert not (run / "config.toml").exists()


def test_ctrl_c_while_workers_start(tmp_path: Path) -> None:
    job = _start([*R.TINY, "--runs-dir", str(tmp_path)], tmp_path)
    run = tmp_path / "tiny"
    _wait_for(job, lambda: (run / "config.toml").exists(), "the workers' start")
    time.sleep(0.5)  # the workers are importing torch or building the model
    _, err = _ctrl_c(job)
    line = _check_one_line(job.returncode, err)
    assert "no checkpoint was saved: rerunning the same command starts the run again" in line
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert _temporary_files(run) == []


def _training(tmp_path: Path, steps: int) -> tuple[subprocess.Popen[str], list[str]]:
    """A long run (400 steps, no save planned) started and past its step ``steps``."""
    args = [*R.TINY, "--steps", "400", "--save-every", "1000", "--eval-every", "0",
            "--runs-dir", str(tmp_path)]  # fmt: skip
    job = _start(args, tmp_path)
    metrics = tmp_path / "tiny" / "metrics.jsonl"
    _wait_for(
        job,
        lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= steps,
        f"step {steps}",
    )
    return job, args


def test_ctrl_c_while_training_saves_the_step(tmp_path: Path) -> None:
    job, _ = _training(tmp_path, 1)
    _, err = _ctrl_c(job)
    line = _check_one_line(job.returncode, err)
    last = max(R.losses(tmp_path / "tiny"))
    assert 1 <= last < 400  # stopped early, after a whole step
    tag = tmp_path / "tiny" / "checkpoints" / f"step_{last:08d}"
    assert (tag / "done").is_file()  # the interrupted step was saved
    assert f"the newest checkpoint is {tag}" in line
    assert _temporary_files(tmp_path / "tiny") == []


@pytest.mark.slow
def test_interrupted_run_resumes_from_the_saved_step(tmp_path: Path) -> None:
    job, args = _training(tmp_path, 2)
    _ctrl_c(job)
    last = max(R.losses(tmp_path / "tiny"))
    done = R.nxd_train([*args, "--steps", str(last + 2)], tmp_path)  # the last flag wins
    assert f"(step {last})" in done.stderr
    assert sorted(R.losses(tmp_path / "tiny")) == list(range(1, last + 3))


def test_ctrl_c_while_a_save_is_in_flight(tmp_path: Path) -> None:
    """A save every step, each rank's background write slowed by 1 s, Ctrl-C after step 2:
    the save in flight completes, then the interrupted step is saved; every tag left is
    complete and intact, the newest is the last step."""
    import nxd_ckpt

    args = [*R.TINY, "--steps", "400", "--save-every", "1", "--eval-every", "0",
            "--runs-dir", str(tmp_path)]  # fmt: skip
    job = _start(args, tmp_path, R.fault_env(tmp_path, "slow_write:1.0"))
    metrics = tmp_path / "tiny" / "metrics.jsonl"
    _wait_for(
        job, lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, "step 2"
    )
    _, err = _ctrl_c(job)
    line = _check_one_line(job.returncode, err)
    last = max(R.losses(tmp_path / "tiny"))
    ckpt = tmp_path / "tiny" / "checkpoints"
    tags = sorted(p.name for p in ckpt.iterdir())
    assert tags[-1] == f"step_{last:08d}", tags
    assert 2 <= len(tags) <= 3  # --keep 3
    for tag in tags:
        assert (ckpt / tag / "done").is_file(), tag
        nxd_ckpt.verify_tag(ckpt, tag)
    assert f"the newest checkpoint is {ckpt / tags[-1]}" in line
    assert _temporary_files(tmp_path / "tiny") == []


def test_workers_stop_when_the_launcher_dies(tmp_path: Path) -> None:
    """SIGKILL of the launcher alone (a lost login session, an OOM kill): its workers get the
    parent-death signal, finish their step, save it and exit; none is left running."""
    job, _ = _training(tmp_path, 1)
    workers = R.children(job.pid)
    assert workers
    job.kill()  # the launcher only
    job.communicate(timeout=R.TIMEOUT)
    deadline = time.monotonic() + STOP_WITHIN_S
    while any(R.alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "workers still running after the launcher died"
        time.sleep(0.1)
    last = max(R.losses(tmp_path / "tiny"))
    assert last < 400
    assert (tmp_path / "tiny" / "checkpoints" / f"step_{last:08d}" / "done").is_file()
