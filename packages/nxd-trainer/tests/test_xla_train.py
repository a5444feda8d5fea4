"""``nxd-train`` end to end on an XLA device (torch-xla's CPU client, the CI stand-in for every
non-CPU device): train, evaluate, checkpoint, resume, export, as a user runs it.

The same tiny run is made with ``--device xla`` in two commands (2 steps, then resumed to 4;
its checkpoints saved asynchronously, copied to host memory before each save returns)
and with ``--device cpu`` in one (4 steps: a resumed CPU run is bitwise the uninterrupted one,
which tests-reliability's kill tests prove): the per-step losses, the validation losses and
the exported weights must agree. Each launch costs a fresh import of torch, transformers and
torch-xla and a fresh compile, so the reference is one launch.

XLA compiles each step into fused kernels whose fp32 sums run in another order: round-off
only, amplified over 4 AdamW steps on near-zero gradient entries, so rtol 1e-4 / atol 1e-5 on
losses and 1e-4 on weights (as the CPU parity tests of the trainer).
Any tensor left on the CPU by the loop (a batch, an evaluation row, a loss sum) fails here:
XLA refuses to mix devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.xla

TOL = {"rtol": 1e-4, "atol": 1e-5}
TINY = [
    "--corpus-mb", "0.3", "--val-fraction", "0.2", "--vocab-size", "320", "--seq-len", "32",
    "--batch-size", "4", "--warmup-steps", "2", "--eval-every", "2", "--eval-batches", "1",
    "--save-every", "2", "--sample-tokens", "4", "--no-progress", "--tp", "1",
    "--nproc-per-node", "1",
]  # fmt: skip
TIMEOUT = int(os.environ.get("NXD_TEST_TIMEOUT", "900"))


def _nxd_train(args: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "nxd_trainer.train", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, f"nxd-train {args} exited {done.returncode}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    return done.stderr


def _rows(run: Path, kind: str) -> dict[int, float]:
    key = "loss" if kind == "train" else "val_loss"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if r["kind"] == kind}


def test_nxd_train_on_xla_equals_cpu(tmp_path: Path) -> None:
    def common(device: str) -> list[str]:
        return [*TINY, "--device", device, "--runs-dir", str(tmp_path), "--name", device]

    _nxd_train([*common("xla"), "--steps", "2", "--no-export"], tmp_path)
    resumed = _nxd_train([*common("xla"), "--steps", "4"], tmp_path)
    assert "resumed from" in resumed
    assert "(step 2)" in resumed
    # Async saves on XLA copy to host memory before the save returns (the log says so).
    assert "async_copy=before_return" in resumed
    assert "checkpoint step_00000004: the loop was blocked" in resumed
    _nxd_train([*common("cpu"), "--steps", "4"], tmp_path)
    xla, cpu = tmp_path / "xla", tmp_path / "cpu"
    assert sorted(_rows(xla, "train")) == [1, 2, 3, 4]
    for kind in ("train", "eval"):
        got, want = _rows(xla, kind), _rows(cpu, kind)
        assert sorted(got) == sorted(want)
        torch.testing.assert_close(
            torch.tensor([got[s] for s in sorted(got)]),
            torch.tensor([want[s] for s in sorted(want)]),
            **TOL,
            msg=kind,
        )
    from safetensors.torch import load_file

    exported, reference = (load_file(r / "hf" / "model.safetensors") for r in (xla, cpu))
    assert exported.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=1e-4, msg=name)
    config = json.loads((xla / "hf" / "config.json").read_text())
    tokenizer = json.loads((xla / "hf" / "tokenizer_config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert tokenizer["eos_token"] == "<|endoftext|>"
