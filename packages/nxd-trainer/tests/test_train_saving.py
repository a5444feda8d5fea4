"""nxd-train's saves without a process group: the ``async_save`` setting (default on, the
``--no-async-save`` flag, TOML and JSON round trips), the save mode per device, and the
:class:`~nxd_trainer.train.saving.Saver`'s bookkeeping: one report per save, a background
failure raised as ``SaveFailed`` naming the tag. The saves themselves, end to end:
tests-integration/train/test_async_save.py."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from nxd_trainer.train import ConfigError, TrainConfig, parse_config
from nxd_trainer.train.saving import SYNC, SaveFailed, Saver, save_mode


def test_async_save_is_the_default_and_round_trips(tmp_path: Path) -> None:
    assert TrainConfig().async_save is True
    cfg = parse_config(["--no-async-save"])
    assert cfg.async_save is False
    assert parse_config(["--async-save"]).async_save is True
    toml = tmp_path / "run.toml"
    toml.write_text(cfg.to_toml())
    assert "async_save = false" in toml.read_text()
    assert parse_config(["--config", str(toml)]) == cfg
    # The checkpoint's user content holds the config as JSON.
    assert TrainConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="async_save must be true or false, got 'no'"):
        TrainConfig(async_save="no")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("async_save", "device", "mode"),
    [
        (True, "cpu", "before_step"),
        (True, "cuda", "before_step"),  # nxd-ckpt copies device tensors before returning
        (True, "xla", "before_return"),  # the deferred copy is not proven on XLA tensors
        (False, "cpu", SYNC),
        (False, "xla", SYNC),
    ],
)
def test_save_mode_per_device(async_save: bool, device: str, mode: str) -> None:
    assert save_mode(async_save, device) == mode
    assert f"async_copy={mode}" in Saver(mode).describe() or mode == SYNC


def _fake_library(monkeypatch: pytest.MonkeyPatch, failure: BaseException | None) -> list[Any]:
    """nxd-trainer's save and nxd-ckpt's finalize replaced: calls recorded, ``failure`` raised
    by the wait."""
    import nxd_ckpt
    import nxd_trainer

    calls: list[Any] = []

    def save_checkpoint(folder: Any, tag: str, **kwargs: Any) -> None:
        calls.append(("save", tag, kwargs["async_save"], kwargs["async_copy"]))

    def finalize_checkpoint(*, release_host_memory: bool = True) -> None:
        calls.append(("wait", release_host_memory))
        if failure is not None:
            raise failure

    monkeypatch.setattr(nxd_trainer, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(nxd_ckpt, "finalize_checkpoint", finalize_checkpoint)
    return calls


def test_one_report_per_save_and_one_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_library(monkeypatch, None)
    saver = Saver("before_step")
    saver.save(tmp_path, "step_00000001")
    assert saver.reports() == []  # its wait is not known before the next step
    with saver.step():
        pass
    (first,) = saver.reports()
    assert (first.tag, first.mode, first.wait_s) == ("step_00000001", "before_step", 0.0)
    assert "checkpoint step_00000001: the loop was blocked" in first.line()
    saver.save(tmp_path, "step_00000002")
    saver.wait(release_host_memory=True)  # the end of the run: the wait is the save's
    (last,) = saver.reports()
    assert last.tag == "step_00000002"
    assert calls == [
        ("wait", False),  # the next save waits for the one in flight first
        ("save", "step_00000001", True, "before_step"),
        ("wait", False),
        ("save", "step_00000002", True, "before_step"),
        ("wait", True),
    ]
    sync = Saver(SYNC)
    sync.save(tmp_path, "step_00000003")
    (report,) = sync.reports()
    assert report.line().startswith("checkpoint step_00000003: saved, the loop was blocked")
    assert calls[-1] == ("save", "step_00000003", False, "before_return")


def test_a_background_failure_names_its_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk_full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x"))
    _fake_library(monkeypatch, disk_full)
    with pytest.raises(OSError, match="No space left") as raw:
        Saver("before_step").wait()  # nothing in flight: the library's error as it is
    assert not isinstance(raw.value, SaveFailed)
    _fake_library(monkeypatch, None)
    saver = Saver("before_step")
    saver.save(tmp_path, "step_00000004")
    _fake_library(monkeypatch, disk_full)
    with pytest.raises(SaveFailed) as caught:
        saver.save(tmp_path, "step_00000006")
    message = str(caught.value)
    assert message.startswith(f"checkpoint {tmp_path / 'step_00000004'} was not saved")
    assert "OSError: [Errno 28] No space left on device" in message
    assert caught.value.__cause__ is disk_full
