"""End to end through Lightning's own launcher: ``python script.py`` with
``Trainer(accelerator="cpu", devices=2, strategy=NxDStrategy(...))`` starts the second process
itself (the default ``"popen"`` start method re-runs the script), TP=2 on gloo on a stock
Hugging Face Llama, and the losses equal one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from nxd_state.testing import load_sibling

HERE = Path(__file__).parent


R = load_sibling(__file__, "_recipe")


def test_lightning_launcher_runs_tp2_like_one_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, str(HERE / "_launch_script.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=float(os.environ.get("NXD_TEST_TIMEOUT", "180")) * 2,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["tp_layers"] > 0 for r in ranks), ranks  # parallelized, not replicated
    reference = R.single_process_run("hf_llama", 3, dp=1)
    for rank in ranks:  # TP=2: both ranks hold the loss; R.TOL: TP-split sums' round-off
        torch.testing.assert_close(
            torch.tensor(rank["losses"]), torch.tensor(reference["losses"]), **R.TOL
        )
