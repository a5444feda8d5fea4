"""SIGKILL of an ``nxd-train`` run during checkpoint saves: the rerun resumes from the newest
complete tag and ends bitwise equal to an uninterrupted run.

The main job itself, not the trainer API: ``python -m nxd_trainer.train`` (the ``nxd-train``
command) is started as a subprocess; it is the launcher and starts its workers through
torch's elastic launch. A tiny run (the ``tiny`` preset, 32-token sequences, batch 2, a
checkpoint after every step, ``--keep 2``, a 512-token BPE on 50 kB of text) is:

1. run once uninterrupted (the reference), the test polling its ``checkpoints/`` folder to
   measure how long a save takes (a ``step_*`` folder appearing -> its ``done`` appearing);
2. run again in another run folder (the reference's ``tokenizer/`` and ``data/`` copied in:
   the data cache is reused, the settings are the same), and killed: when the folder of the
   target save appears, the test waits a random delay drawn over the measured save window
   and SIGKILLs every worker **and** the launcher at once (a lost node); then the same
   command is rerun, killed again in a later save, ... and finally rerun to the end.

Checked:

* every rerun printed ``resumed from .../step_N (step N)`` with N the newest complete tag
  on disk before it started (or no resume line when there was none): never a torn tag;
* the final per-step losses in ``metrics.jsonl`` (the last line written for each step) and
  ``summary.json`` (step, tokens, loss, checkpoint tag, interrupted) equal the reference's
  **bitwise**: same operations in the same order on CPU, so any difference is state the
  checkpoint lost or tore (the loader position, the RNG, the optimizer, the scheduler);
* every killed process is gone and none of them left a child (``/proc``); a finished run
  leaves no process behind either.

CI: 2 kills of a 1-process run (4 launches: the reference, 2 killed, the last rerun; each
launch is 20-45 s on 2 shared cores). ``-m slow``: 8 more kills of a 1-process run and 4 of a
2-process TP=2 run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nxd_state.testing import load_sibling

P = load_sibling(__file__, "_procs")
RUN_TIMEOUT = 600.0
# The default corpus (the Python standard library's sources: deterministic, no download).
_FLAGS = [
    "--vocab-size", "512", "--seq-len", "32", "--batch-size", "2", "--corpus-mb", "0.05",
    "--val-fraction", "0.3", "--eval-every", "0", "--eval-batches", "1", "--no-export",
    "--no-progress", "--save-every", "1", "--keep", "2", "--device", "cpu",
    "--warmup-steps", "2",
]  # fmt: skip
_RESUMED = re.compile(r"resumed from \S*step_(\d+) \(step (\d+)\)")


def _command(runs: Path, name: str, steps: int, nproc: int, tp: int) -> list[str]:
    return [
        sys.executable, "-m", "nxd_trainer.train", "--runs-dir", str(runs), "--name", name,
        "--steps", str(steps), "--nproc-per-node", str(nproc), "--tp", str(tp), *_FLAGS,
    ]  # fmt: skip


def _descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``root`` (the start time tells a reused
    pid apart)."""
    table = P.process_table()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        children = {pid for pid, proc in table.items() if proc.parent in frontier} - found
        found |= children
        frontier = children
    return {(pid, table[pid].start) for pid in found if table[pid].live}


def _alive(process: tuple[int, int]) -> bool:
    """Whether this very process (pid and start time) runs; a zombie counts as gone."""
    entry = P.process_table().get(process[0])
    return entry is not None and entry.start == process[1] and entry.live


def _newest_complete_step(ckpt: Path) -> int | None:
    if not ckpt.is_dir():
        return None
    steps = [int(p.name[5:]) for p in ckpt.glob("step_*") if (p / "done").is_file()]
    return max(steps) if steps else None


def _logged_steps(run: Path, since: float = 0.0) -> set[int]:
    """Steps with a complete ``metrics.jsonl`` line stamped at or after ``since`` (wall time;
    the worker writes a step's line, flushed, right before that step's save starts; a resumed
    run rewrites the file, so byte offsets cannot tell its lines apart)."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return set()
    steps = set()
    for line in text.split("\n")[:-1]:  # the last piece may be a line being written
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a kill, or caught between two write calls
            continue
        if row["kind"] == "train" and row["time"] >= since:
            steps.add(row["step"])
    return steps


def _tag(ckpt: Path, step: int) -> Path:
    return ckpt / f"step_{step:08d}"


_JOBS: list[_Job] = []


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test() -> Iterator[None]:
    """A failed assertion must not leave a job running (it would load the machine)."""
    yield
    while _JOBS:
        job = _JOBS.pop()
        if job.proc.poll() is None:
            job.kill_all()


class _Job:
    """One ``nxd-train`` command as a subprocess; every process it started is remembered."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        self._out = log.open("w")
        env = {**os.environ, "NXD_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.seen: set[tuple[int, int]] = set()
        self._scanned = 0.0
        _JOBS.append(self)

    def poll(self) -> int | None:
        now = time.monotonic()
        if now - self._scanned > 0.2:  # /proc scans cost CPU the job needs
            self.seen |= _descendants(self.proc.pid)
            self._scanned = now
        return self.proc.poll()

    def text(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text()

    def kill_all(self) -> int:
        """SIGKILL the workers and the launcher at once (every live process the job started,
        from a fresh scan, then the launcher)."""
        live = _descendants(self.proc.pid)
        self.seen |= live
        for pid, _ in sorted(live):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        return self.proc.wait(60)

    def wait(self) -> int:
        deadline = time.monotonic() + RUN_TIMEOUT
        while self.poll() is None:
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)
        return self.proc.returncode

    def assert_nothing_left(self) -> None:
        """Every process of the job is gone and none left a child behind."""
        self._out.close()
        assert self.seen, "no worker process was seen"
        deadline = time.monotonic() + 30
        while [p for p in self.seen if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in self.seen if _alive(p)] == [], self.seen
        pids = {self.proc.pid} | {pid for pid, _ in self.seen}
        table = P.process_table()
        orphans = [pid for pid, proc in table.items() if proc.parent in pids and proc.live]
        assert orphans == [], orphans


def _final_losses(run: Path) -> dict[int, float]:
    """The loss of every step, from the last line written for it (reruns rewrite steps)."""
    losses = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "train":
            losses[row["step"]] = row["loss"]
    return losses


def _summary(run: Path) -> dict[str, Any]:
    data = json.loads((run / "summary.json").read_text())
    data.pop("tokens_per_s")  # a speed: differs between runs
    data["checkpoint"] = Path(data["checkpoint"]).name  # the run folders differ
    return data


def _reference(tmp: Path, steps: int, nproc: int, tp: int) -> tuple[Path, float]:
    """The uninterrupted run, and the median seconds a save takes (from the step's metrics
    line, written right before the save starts, to the tag's ``done``)."""
    runs = tmp / "runs"
    job = _Job(_command(runs, "reference", steps, nproc, tp), tmp / "reference.log")
    run = runs / "reference"
    started: dict[int, float] = {}
    windows: dict[int, float] = {}
    while job.poll() is None:
        now = time.monotonic()
        for step in _logged_steps(run):
            started.setdefault(step, now)
        for step, t in started.items():
            if step not in windows and (_tag(run / "checkpoints", step) / "done").exists():
                windows[step] = now - t
        time.sleep(0.001)
    assert job.proc.returncode == 0, job.text()[-3000:]
    job.assert_nothing_left()
    assert len(windows) >= steps // 2, windows
    return runs / "reference", statistics.median(windows.values())


def _kill_chain(tmp: Path, kills: int, *, steps: int, nproc: int, tp: int, seed: int) -> dict:
    reference, window = _reference(tmp, steps, nproc, tp)
    runs = tmp / "runs"
    run = runs / "killed"
    run.mkdir(parents=True)
    for reused in ("tokenizer", "data"):  # same settings: the reference's cache is valid
        shutil.copytree(reference / reused, run / reused)
    ckpt = run / "checkpoints"
    rng = random.Random(seed)
    phases = {"in save": 0, "after commit": 0}
    resumes, seconds = [], []
    for attempt in range(kills + 1):
        began = time.monotonic()
        expected = _newest_complete_step(ckpt)
        launched = time.time()  # lines stamped after it are this session's
        last = attempt == kills
        job = _Job(_command(runs, "killed", steps, nproc, tp), tmp / f"job{attempt}.log")
        if last:
            assert job.wait() == 0, job.text()[-3000:]
        else:
            # The save to kill: the first after the resume or, while steps are left for the
            # remaining kills, the second (never the last step's).
            start = expected or 0
            left = kills - attempt - 1
            skip = rng.randrange(2) if start + 2 + left <= steps - 1 else 0
            target_step = start + 1 + skip
            target = _tag(ckpt, target_step)
            delay = rng.uniform(0.0, window)
            deadline = time.monotonic() + RUN_TIMEOUT
            # Not the tag folder's appearance: a torn folder of an earlier kill may be there.
            while target_step not in _logged_steps(run, launched):
                assert job.poll() is None, job.text()[-3000:]
                assert time.monotonic() < deadline, job.text()[-3000:]
                time.sleep(0.001)
            time.sleep(delay)
            committed = (target / "done").exists()
            code = job.kill_all()
            assert code == -signal.SIGKILL, (code, job.text()[-3000:])
            phases["after commit" if committed else "in save"] += 1
        job.assert_nothing_left()
        found = [(int(a), int(b)) for a, b in _RESUMED.findall(job.text())]
        assert found == ([(expected, expected)] if expected else []), (found, expected)
        resumes.append(expected or 0)
        seconds.append(round(time.monotonic() - began, 1))
    assert _final_losses(run) == _final_losses(reference)  # bitwise: floats compared exactly
    assert sorted(_final_losses(run)) == list(range(1, steps + 1))
    assert _summary(run) == _summary(reference)
    # Most kills land inside the save (a loaded machine moves some just past its commit).
    assert phases["in save"] >= kills / 2, phases
    return {"phases": phases, "resumed_from": resumes, "save_window_s": window,
            "launch_s": seconds}  # fmt: skip


def test_sigkill_nxd_train_during_saves(tmp_path: Path) -> None:
    report = _kill_chain(tmp_path, 2, steps=5, nproc=1, tp=1, seed=0)
    print("nxd-train kills:", report)


@pytest.mark.slow
def test_sigkill_nxd_train_during_saves_many(tmp_path: Path) -> None:
    report = _kill_chain(tmp_path, 8, steps=12, nproc=1, tp=1, seed=1)
    print("nxd-train kills:", report)


@pytest.mark.slow
def test_sigkill_nxd_train_tp2_during_saves(tmp_path: Path) -> None:
    report = _kill_chain(tmp_path, 4, steps=8, nproc=2, tp=2, seed=2)
    print("nxd-train tp=2 kills:", report)


@pytest.mark.slow
def test_sigkill_after_the_final_tag_committed(tmp_path: Path) -> None:
    """A lost node right after the last save's commit: the rerun changes nothing."""
    steps = 4
    reference, _ = _reference(tmp_path, steps, 1, 1)
    runs = tmp_path / "runs"
    run = runs / "killed"
    run.mkdir(parents=True)
    for reused in ("tokenizer", "data"):
        shutil.copytree(reference / reused, run / reused)
    job = _Job(_command(runs, "killed", steps, 1, 1), tmp_path / "killed.log")
    final = _tag(run / "checkpoints", steps) / "done"
    deadline = time.monotonic() + RUN_TIMEOUT
    while not final.exists() and job.poll() is None:
        assert time.monotonic() < deadline, job.text()[-3000:]
        time.sleep(0.001)
    assert final.exists(), job.text()[-3000:]
    job.kill_all()  # or it already ended: the rerun must change nothing either way
    job.assert_nothing_left()
    rerun = _Job(_command(runs, "killed", steps, 1, 1), tmp_path / "rerun.log")
    assert rerun.wait() == 0, rerun.text()[-3000:]
    rerun.assert_nothing_left()
    # The workers resume the final tag and train nothing; or, when the kill came after the
    # summary was written, the launcher sees a finished run and starts nothing.
    text = rerun.text()
    assert (
        f"resumed from {_tag(run / 'checkpoints', steps)}" in text
        or f"the run {run} is finished (step {steps}" in text
    ), text[-3000:]
    assert _final_losses(run) == _final_losses(reference)
    assert _summary(run) == _summary(reference)
