"""A rank that raises, exits, is SIGKILLed or hangs mid-step never hangs the job.

The training job (``_job.train``, no checkpoints) runs on ranks started without supervision
(``nxd_state.testing.launch_ranks``: a failing rank exits non-zero as under ``torchrun`` and
nobody stops its peers). One rank fails on entering its k-th call of a collective of
``nxd_state.collectives`` while its peers are in that collective or transfer: the TP
all-reduce of a row-parallel layer, the DP gradient all-reduce, the pipeline's stage-to-stage
transfers (``batch_send_recv``, ``isend``/``irecv``). Each case proves:

* every other rank exits non-zero by itself, within the configured collective timeout
  (``NXD_COLLECTIVE_TIMEOUT_S``) of the failure;
* its error is ``nxd_state.RankFailureError`` naming the failed rank (``rank <r> (pid ...``)
  and how it ended (died / raised / exited / never joined);
* the failed rank's own exit code is what it did (1 for an exception, 3 for ``exit(3)``,
  -9 for SIGKILL);
* no process is left: every rank's pid is gone and none has children (``/proc``); only a
  hanging rank is left for the launcher to kill, and it is the only one.

``torchrun`` as the launcher: its exit code is non-zero and it names the failed rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from nxd_state.testing import launch_ranks, load_sibling, process_alive

P = load_sibling(__file__, "_procs")

TIMEOUT_S = 30.0  # the collective timeout the jobs run with (NXD_COLLECTIVE_TIMEOUT_S)
HANG_TIMEOUT_S = 8.0  # for the hanging rank: the survivors must wait out this timeout
# Beyond the timeout: a loaded 2-core machine needs seconds to tear a process down.
SLACK_S = 20.0

EXIT_CODES = {"raise": 1, "exit": 3, "os_exit": 3, "sigkill": -signal.SIGKILL}
WORDS = {
    "raise": "raised ValueError: injected failure",
    "exit": "exited (sys.exit(3))",
    "os_exit": "died without recording an exit",
    "sigkill": "died without recording an exit",
    "hang": "is alive",
}


def _run_case(
    tmp: Path, world: int, job: dict[str, Any], victim: int, op: str, how: str, call: int = 1
) -> dict[str, Any]:
    timeout = HANG_TIMEOUT_S if how == "hang" else TIMEOUT_S
    fault = {"rank": victim, "op": op, "call": call, "how": how}
    import nxd_reliability_job as J

    with launch_ranks(
        J.train,
        world,
        None,
        log_dir=tmp / "logs",
        env={"NXD_COLLECTIVE_TIMEOUT_S": str(timeout)},
        fault=fault,
        **job,
    ) as ranks:
        survivors = [r for r in range(world) if r != victim]
        codes = ranks.wait(timeout * 3 + 120, survivors)
        logs = {r: ranks.log(r) for r in range(world)}
        for rank in survivors:
            assert codes[rank] not in (None, 0), (rank, codes, logs[rank][-3000:])
        if how == "hang":
            assert codes[victim] is None, codes  # alive: the launcher's to kill
        else:
            assert codes[victim] == EXIT_CODES[how], (codes, logs[victim][-3000:])
            # Survivors exit within the timeout of the victim's end (the victim exited first).
            first = ranks.exit_times[victim]
            for rank in survivors:
                assert ranks.exit_times[rank] - first <= timeout + SLACK_S, ranks.exit_times
        for rank in survivors:
            log = logs[rank]
            assert "RankFailureError" in log, log[-3000:]
            assert f"rank {victim} (pid" in log, log[-3000:]
            assert WORDS[how] in log, log[-3000:]
        pids = ranks.pids
        leftover = ranks.close()
    assert leftover == ([victim] if how == "hang" else []), leftover
    assert not [pid for pid in pids if process_alive(pid)]
    assert [pid for pid, p in P.process_table().items() if p.parent in pids] == []
    return {"codes": codes, "exit_times": ranks.exit_times}


TP2 = {"tp": 2}
DP2: dict[str, Any] = {}
PP2 = {"pp": 2}
CI_CASES = [
    # (world, job, victim, op, how, call): TP mid-collective, DP, PP mid-p2p, 3D.
    pytest.param(2, TP2, 1, "all_reduce", "sigkill", 3, id="tp-allreduce-sigkill"),
    pytest.param(2, DP2, 0, "all_reduce", "raise", 1, id="dp-grad-allreduce-raise"),
    pytest.param(2, PP2, 1, "p2p", "os_exit", 1, id="pp-p2p-os_exit"),
    pytest.param(2, TP2, 0, "all_reduce", "exit", 2, id="tp-allreduce-exit"),
    pytest.param(4, {"tp": 2, "pp": 2}, 3, "p2p", "sigkill", 1, id="tp2pp2-p2p-sigkill"),
    pytest.param(2, TP2, 1, "all_reduce", "hang", 3, id="tp-allreduce-hang"),
]
SLOW_CASES = [
    pytest.param(world, job, victim, op, how, call, id=f"{name}-{how}")
    for how in ("raise", "exit", "os_exit", "sigkill")
    for name, world, job, victim, op, call in (
        ("tp", 2, TP2, 0, "all_reduce", 5),
        ("dp", 2, DP2, 1, "all_reduce", 2),
        ("pp", 2, PP2, 0, "p2p", 2),
        ("dp2tp2", 4, {"tp": 2}, 2, "all_reduce", 4),
        ("pp2dp2", 4, {"pp": 2}, 1, "p2p", 1),
    )
]


@pytest.mark.parametrize(("world", "job", "victim", "op", "how", "call"), CI_CASES)
def test_rank_failure_ends_every_rank_and_names_it(
    tmp_path: Path, world: int, job: dict[str, Any], victim: int, op: str, how: str, call: int
) -> None:
    _run_case(tmp_path, world, job, victim, op, how, call)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job", "victim", "op", "how", "call"), SLOW_CASES)
def test_rank_failure_matrix(
    tmp_path: Path, world: int, job: dict[str, Any], victim: int, op: str, how: str, call: int
) -> None:
    _run_case(tmp_path, world, job, victim, op, how, call)


def test_torchrun_exit_code_is_nonzero_and_names_the_rank(tmp_path: Path) -> None:
    """torchrun (the launcher NxD jobs use) with rank 1 SIGKILLed in a TP all-reduce."""
    script = tmp_path / "job.py"
    job_file = Path(__file__).with_name("_job.py")
    script.write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location("job", {str(job_file)!r})
            job = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(job)
            job.train(None, steps=3, tp=2,
                      fault={{"rank": 1, "op": "all_reduce", "call": 3, "how": "sigkill"}})
            """
        )
    )
    env = {**os.environ, "NXD_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S), "NXD_DEVICE": "cpu"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--monitor-interval=0.5",
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, output[-3000:]
    assert "rank      : 1" in output or "rank: 1" in output, output[-3000:]
    assert "Signal 9 (SIGKILL)" in output or "exitcode  : -9" in output, output[-3000:]
    assert time.monotonic() - start < 600
    # Nothing of the job is left: no process in its session (torchrun and its workers).
    leftover = [pid for pid, p in P.process_table().items() if p.session == proc.pid]
    assert leftover == [], leftover
