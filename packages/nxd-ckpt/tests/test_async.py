"""Async save: same bytes as a sync save, a snapshot taken at save time, errors never lost;
and a full disk during a save (sync or async) leaves the previous tag loadable. With
``async_copy="before_step"`` the copy happens after the call returns and the next optimizer
step waits for it (still a snapshot); a change outside a step is refused, not saved torn."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import nxd_ckpt
from nxd_ckpt import finalize_checkpoint, load_checkpoint, save_checkpoint
from nxd_ckpt.format import _stfile
from nxd_ckpt.save import _save
from nxd_state.testing import run_distributed


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))


def _normalised_index(tag: Path) -> dict:
    """The index with the save id (random per save) and tag name taken out."""
    index = nxd_ckpt.read_index(tag)
    text = tag.joinpath("index.json").read_text().replace(index.save_id, "ID")
    document = json.loads(text)
    document.pop("tag")
    return document


def _assert_same_bytes(a: Path, b: Path) -> int:
    assert _normalised_index(a) == _normalised_index(b)
    files_a = sorted(a.glob("data-*/*.safetensors"))
    files_b = sorted(b.glob("data-*/*.safetensors"))
    assert [f.name for f in files_a] == [f.name for f in files_b]
    for x, y in zip(files_a, files_b):
        assert x.read_bytes() == y.read_bytes(), x.name
    return len(files_a)


def test_async_save_equals_sync_save_byte_for_byte(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    torch.manual_seed(5)
    save_checkpoint(tmp_path, "sync", model=model, optimizer=optimizer, user_content={"a": 1})
    torch.manual_seed(5)  # the RNG state is saved too
    save_checkpoint(
        tmp_path, "async", model=model, optimizer=optimizer, user_content={"a": 1}, async_save=True
    )
    finalize_checkpoint()
    assert _assert_same_bytes(tmp_path / "sync", tmp_path / "async") == 1


def _two_rank_sync_and_async(path: str) -> None:
    from nxd_ckpt.testing import Degrees, build, train_step

    model, optimizer = build(Degrees(tp=1, pp=1, dp=2, zero1=True))
    train_step(model, optimizer, 0)
    torch.manual_seed(1)
    save_checkpoint(path, "sync", model=model, optimizer=optimizer)
    torch.manual_seed(1)
    save_checkpoint(path, "async", model=model, optimizer=optimizer, async_save=True)
    torch.manual_seed(1)
    save_checkpoint(
        path,
        "deferred",
        model=model,
        optimizer=optimizer,
        async_save=True,
        async_copy="before_step",
    )
    train_step(model, optimizer, 1)  # training goes on (its ZeRO-1 step waits for the copy)
    finalize_checkpoint()


def test_async_equals_sync_on_two_ranks_with_zero1(tmp_path: Path) -> None:
    run_distributed(_two_rank_sync_and_async, 2, str(tmp_path))
    assert _assert_same_bytes(tmp_path / "sync", tmp_path / "async") == 2  # both DP ranks write
    assert _assert_same_bytes(tmp_path / "sync", tmp_path / "deferred") == 2


def test_async_save_is_a_snapshot_and_the_next_save_waits(tmp_path: Path) -> None:
    model = _model()
    expected = model[0].weight.detach().clone()
    save_checkpoint(tmp_path, "a", model=model, async_save=True)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the training step after the save call
    save_checkpoint(tmp_path, "b", model=model, async_save=True)  # waits for "a" first
    finalize_checkpoint()
    loaded = _model(seed=1)
    load_checkpoint(tmp_path, "a", model=loaded)
    assert torch.equal(loaded[0].weight, expected)
    load_checkpoint(tmp_path, "b", model=loaded)
    assert torch.equal(loaded[0].weight, expected + 1.0)


def _slow_deferred_copy(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, float]]) -> None:
    """The background copy starts 0.3 s late, so the caller's next step comes first."""
    real = _save.copy_deferred

    def copy(copies: list) -> None:
        time.sleep(0.3)
        real(copies)
        events.append(("copied", time.perf_counter()))

    monkeypatch.setattr(_save, "copy_deferred", copy)


def test_deferred_copy_is_a_snapshot_taken_before_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """async_copy="before_step": the call returns before copying parameters and optimizer
    state; the next optimizer.step waits for the copy (same bytes as a sync save of the
    state at save time); buffers changed by the next forward were copied at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    torch.manual_seed(5)
    save_checkpoint(tmp_path, "sync", model=model, optimizer=optimizer)
    events: list[tuple[str, float]] = []
    _slow_deferred_copy(monkeypatch, events)
    torch.manual_seed(5)
    save_checkpoint(
        tmp_path,
        "deferred",
        model=model,
        optimizer=optimizer,
        async_save=True,
        async_copy="before_step",
    )
    events.append(("returned", time.perf_counter()))
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 32)).sum().backward()  # changes BatchNorm's running stats at once
    optimizer.step()  # waits for the copy
    events.append(("stepped", time.perf_counter()))
    finalize_checkpoint()
    assert [name for name, _ in sorted(events, key=lambda e: e[1])] == [
        "returned",
        "copied",
        "stepped",
    ]
    assert not torch.equal(model[0].weight, before)  # the step did run
    assert _assert_same_bytes(tmp_path / "sync", tmp_path / "deferred") == 1


def test_deferred_copy_refuses_a_change_outside_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    original = model[0].weight.detach().clone()
    save_checkpoint(tmp_path, "good", model=model)
    _slow_deferred_copy(monkeypatch, [])
    save_checkpoint(tmp_path, "torn", model=model, async_save=True, async_copy="before_step")
    with torch.no_grad():
        model[0].weight.add_(1.0)  # not an optimizer step: the copy would be torn
    with pytest.raises(RuntimeError, match=r"\['model 0.weight'\] changed in place after"):
        finalize_checkpoint()
    assert not (tmp_path / "torn" / "done").exists()
    loaded = _model(seed=2)
    load_checkpoint(tmp_path, model=loaded)  # the newest complete tag: "good"
    assert torch.equal(loaded[0].weight, original)
    with pytest.raises(ValueError, match="async_copy must be one of"):
        save_checkpoint(tmp_path, "x", model=model, async_save=True, async_copy="later")


def _full_disk(after_bytes: int):
    real = _stfile._write_all
    written = [0]

    def write_all(fd: int, view: memoryview) -> None:
        if written[0] + len(view) > after_bytes:
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += len(view)
        real(fd, view)

    return write_all


def test_full_disk_during_sync_save_keeps_the_previous_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    save_checkpoint(tmp_path, "good", model=model)
    monkeypatch.setattr(_stfile, "_write_all", _full_disk(4096))
    with pytest.raises(OSError, match=r"writing checkpoint file .*\.safetensors failed: No space"):
        save_checkpoint(tmp_path, "full", model=_model(seed=1))
    monkeypatch.undo()
    assert not (tmp_path / "full" / "done").exists()
    assert not list((tmp_path / "full").glob("data-*/*.tmp"))  # the partial file is removed
    loaded = _model(seed=2)
    load_checkpoint(tmp_path, model=loaded)  # tag=None: the newest complete one is "good"
    assert torch.equal(loaded[0].weight, model[0].weight)


def test_full_disk_during_async_save_raises_at_finalize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    save_checkpoint(tmp_path, "good", model=model)
    monkeypatch.setattr(_stfile, "_write_all", _full_disk(4096))
    save_checkpoint(tmp_path, "full", model=_model(seed=1), async_save=True)  # returns at once
    with pytest.raises(OSError, match="No space left on device"):
        finalize_checkpoint()
    monkeypatch.undo()
    assert not (tmp_path / "full" / "done").exists()
    finalize_checkpoint()  # the error was reported once, nothing is pending
    loaded = _model(seed=2)
    load_checkpoint(tmp_path, model=loaded)
    assert torch.equal(loaded[0].weight, model[0].weight)


def test_interpreter_exit_waits_for_an_async_save(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import torch, nxd_ckpt
        model = torch.nn.Linear(256, 256)
        nxd_ckpt.save_checkpoint({str(tmp_path)!r}, "last", model=model, async_save=True)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    assert (tmp_path / "last" / "done").exists()
    load_checkpoint(tmp_path, "last", model=nn.Linear(256, 256))
