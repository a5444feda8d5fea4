"""SIGKILL a saving process at random moments: the newest complete tag always loads.

A forked child saves in a loop (new tags with ``num_kept_ckpts=3``, and a re-save of one tag,
``latest``, every time), each save holding tensors whose values encode its step. The parent
kills it with SIGKILL after a random delay, then checks: at least one complete tag exists,
``load_checkpoint(tag=None)`` loads, and every complete tag (including ``latest``) verifies
its checksums and holds one consistent step (model values == user content step). The next
round continues in the same folder, so killed saves, killed re-saves and killed deletions
accumulate. 12 rounds by default; 60 under ``-m slow``.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_ckpt.format import _tags
from nxd_ckpt.load._reader import CheckpointReader


def _model(step: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 64))
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.fill_(step + index / 10)
    return model


def _saver(path: str, start: int) -> None:
    torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP pool
    for step in range(start, start + 10_000):
        model = _model(step)
        content = {"step": step}
        save_checkpoint(path, f"s{step:05d}", model=model, user_content=content, num_kept_ckpts=3)
        save_checkpoint(path, "latest", model=model, user_content=content)


def _check_folder(path: Path) -> int:
    """Every complete tag is intact and consistent; returns the newest complete step."""
    complete = [tag for tag in _tags.list_tags(path) if tag.complete]
    assert complete, f"no complete tag left in {path}"
    for tag in complete:
        CheckpointReader(tag.path).verify_files()
        model = _model(-1)
        content = load_checkpoint(path, tag.name, model=model)
        for index, param in enumerate(model.parameters()):
            expected = content["step"] + index / 10
            assert torch.all(param == expected), f"tag {tag.name}: torn save"
    newest = _model(-1)
    return load_checkpoint(path, model=newest)["step"]


def _run_rounds(path: Path, rounds: int, seed: int) -> list[int]:
    context = multiprocessing.get_context("fork")
    rng = random.Random(seed)
    save_checkpoint(path, "s00000", model=_model(0), user_content={"step": 0})
    newest, seen = 0, []
    for _ in range(rounds):
        child = context.Process(target=_saver, args=(str(path), newest + 1), daemon=True)
        child.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL, child.exitcode
        newest = max(newest, _check_folder(path))
        seen.append(newest)
    return seen


def test_sigkill_during_saves_never_damages_the_newest_complete_tag(tmp_path: Path) -> None:
    steps = _run_rounds(tmp_path, rounds=12, seed=0)
    assert steps[-1] > 0  # the child got saves done between the kills


@pytest.mark.slow
def test_sigkill_many_rounds(tmp_path: Path) -> None:
    steps = _run_rounds(tmp_path, rounds=60, seed=1)
    assert steps[-1] > 0
