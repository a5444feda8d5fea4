"""Helpers of the nxd-train suite (loaded by path, not a test module): run the real command in
a subprocess, read what it wrote, and train the same model in this process as the reference.

The reference is the unmodified Hugging Face ``LlamaForCausalLM`` with torch's ``AdamW``,
``clip_grad_norm_`` and the run's LR schedule, fed the run's own packed data (its cache) in
one process with the whole global batch; nxd-train's parallel runs must follow it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

TIMEOUT = int(os.environ.get("NXD_TEST_TIMEOUT", "600"))
# Tiny and quick: ~0.5 MB of the standard library, a 384-token BPE, 4 sequences of 32 tokens
# per step, a few steps. The tiny preset itself (4 layers, hidden 128) is what runs.
TINY = [
    "--corpus-mb", "0.5", "--val-fraction", "0.2", "--vocab-size", "384", "--seq-len", "32",
    "--batch-size", "4", "--warmup-steps", "2", "--eval-every", "3", "--eval-batches", "1",
    "--save-every", "2", "--keep", "3", "--sample-tokens", "4", "--no-progress",
]  # fmt: skip


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    out.pop("TORCHELASTIC_RUN_ID", None)
    out["OMP_NUM_THREADS"] = "1"
    return out


def fault_env(tmp: Path, spec: str) -> dict[str, str]:
    """Environment variables that install the save fault ``spec`` (``_save_faults.py``, as
    the ``sitecustomize`` of every worker) for :func:`nxd_train`'s ``extra_env``."""
    import shutil

    folder = tmp / "faults"
    folder.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).with_name("_save_faults.py"), folder / "sitecustomize.py")
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "NXD_TEST_SAVE_FAULT": spec}


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "nxd_trainer.train", *args]


def nxd_train(
    args: list[str], cwd: Path, check: bool = True, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``nxd-train ARGS`` as a user runs it (the launcher, which spawns the workers);
    ``extra_env``: more environment variables for every process of the run."""
    done = subprocess.run(
        command(args), cwd=cwd, env={**env(), **(extra_env or {})}, capture_output=True,
        text=True, timeout=TIMEOUT,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(
            f"nxd-train {' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
    return done


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rows(run: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run, "train")}


def tb_scalars(run: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's TensorBoard event files: tag -> step -> value."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted((run / "tb").rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord: length (8), crc (4), payload, crc (4)
            length = int.from_bytes(data[offset : offset + 8], "little")
            record = data[offset + 12 : offset + 12 + length]
            offset += 16 + length
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def config(run: Path, extra: list[str]) -> Any:
    from nxd_trainer.train import parse_config

    return parse_config([*TINY, "--runs-dir", str(run.parent), "--name", run.name, *extra])


def reference(run: Path, extra: list[str], plan: list[tuple[int, list[str]]]) -> dict[str, Any]:
    """Train in this process: ``plan`` is ``[(up_to_step, flags), ...]``; each segment uses
    the LR horizon of its flags' ``--steps`` (as a rerun with more steps does)."""
    from transformers import AutoModelForCausalLM

    from nxd_trainer.train.data import PackedLoader, prepare_data
    from nxd_trainer.train.model import hf_config, model_source
    from nxd_trainer.train.trainer import lr_lambda

    cfg = config(run, extra + plan[0][1])
    tokenizer, train, valid = prepare_data(cfg, build=False)
    model_config = hf_config(cfg, len(tokenizer), tokenizer)
    torch.manual_seed(cfg.seed)
    kind, folder = model_source(cfg)
    if kind == "folder":  # fine-tuning a Hugging Face folder: its weights
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=model_config, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    loader = PackedLoader(train, cfg.batch_size, 0, 1, cfg.seed)
    out: dict[int, float] = {}
    step = 0
    for until, flags in plan:
        scheduler.lr_lambdas = [lr_lambda(config(run, extra + flags))]
        while step < until:
            ids = loader.next_batch()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            out[step] = loss.item()
    model.eval()
    return {"losses": out, "model": model, "valid": valid}


def refusal(argv: list[str], capsys: Any) -> str:
    """The one ``nxd-train: error:`` line of a refused command line (exit 2, no traceback);
    ``capsys``: pytest's fixture."""
    from nxd_trainer.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("nxd-train: error:")]
    assert len(lines) == 1, err
    return str(lines[0])
