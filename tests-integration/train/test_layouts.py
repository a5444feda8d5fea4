"""``nxd-train`` at other layouts, each following the one-process reference (``_run.py``):
TP=2 x PP=2 on 4 ranks (1F1B, 2 micro-batches; ``-m slow``), PP=2 with full activation
checkpointing (``-m slow``; the layers' recompute is checked bitwise by the trainer API's
test), and two "nodes" on localhost
(two launchers, one process each, a static rendezvous on the loopback) training one TP=2
model together.

Tolerances as in ``test_train.py`` (fp32 re-association amplified by AdamW).
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
import torch

from nxd_state.testing import load_sibling

R = load_sibling(__file__, "_run")
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _check(run: Path, steps: int) -> None:
    got = R.losses(run)
    ref = R.reference(run, [], [(steps, ["--steps", str(steps)])])
    assert sorted(got) == list(range(1, steps + 1))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in range(1, steps + 1)]),
        torch.tensor([ref["losses"][s] for s in range(1, steps + 1)]),
        **TOL,
    )


@pytest.mark.slow
def test_tp2_pp2_on_four_ranks(tmp_path: Path) -> None:
    layout = ["--tp", "2", "--pp", "2", "--nproc-per-node", "4", "--microbatches", "2"]
    R.nxd_train([*R.TINY, *layout, "--steps", "3", "--runs-dir", str(tmp_path)], tmp_path)
    _check(tmp_path / "tiny", 3)
    assert (tmp_path / "tiny" / "hf" / "config.json").is_file()  # exported from PP=2 shards


@pytest.mark.slow
def test_pp2_with_activation_checkpointing(tmp_path: Path) -> None:
    layout = ["--tp", "1", "--pp", "2", "--nproc-per-node", "2", "--microbatches", "2",
              "--activation-checkpointing", "full", "--no-export"]  # fmt: skip
    R.nxd_train([*R.TINY, *layout, "--steps", "2", "--runs-dir", str(tmp_path)], tmp_path)
    _check(tmp_path / "tiny", 2)


def test_two_nodes_on_localhost(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --no-export: the export is test_train.py's
    common = [*R.TINY, "--steps", "3", "--runs-dir", str(tmp_path), "--nnodes", "2",
              "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--no-export"]  # fmt: skip
    nodes = [
        subprocess.Popen(
            R.command([*common, "--node-rank", str(rank)]),
            cwd=tmp_path,
            env=R.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=R.TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "world 2, tp=2 pp=1 dp=1" in outputs[0]
    _check(tmp_path / "tiny", 3)
