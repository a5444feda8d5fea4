"""Hostile files: a pickle that would run code is never executed by any loader.

Every payload is a pickle whose unpickling calls ``Path.write_text(marker, ...)``: if any
loader ever unpickles it with the full unpickler, the marker file appears. Each case asserts
the marker never appears, and that the loader either ignores the stray file (it is not part
of the format) or refuses it with an error naming the file; pickled files NxD itself writes
(``user_content.pt``, ``scheduler.pt``) are read only with ``allow_pickle=True``, and
weights only with ``torch.load(weights_only=True)``, which refuses the payload even then.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nxd_ckpt
from nxd_ckpt import legacy


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:  # what unpickling would call
        return (Path.write_text, (self.marker, "code ran"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def _weights_with_payload(marker: Path) -> dict[str, Any]:
    state: dict[str, Any] = dict(_model().state_dict())
    state["0.weight"] = _Payload(marker)
    return state


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "CODE_RAN"
    yield path
    assert not path.exists(), "a planted pickle was executed"


def test_pickles_planted_in_an_nxd_checkpoint_are_ignored(tmp_path: Path, marker: Path) -> None:
    model = _model()
    nxd_ckpt.save_checkpoint(tmp_path / "ckpt", "t", model=model, user_content={"step": 3})
    tag = tmp_path / "ckpt" / "t"
    data = next(tag.glob("data-*"))
    for where in (tag, data, tag / "model"):
        where.mkdir(exist_ok=True)
        for name in ("user_content.pt", "scheduler.pt", "model.pt", "x.pkl", "rng.pt"):
            (where / name).write_bytes(pickle.dumps(_Payload(marker)))
    (tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_bytes(
        pickle.dumps(_Payload(marker))
    )
    loaded = _model()
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()
    assert nxd_ckpt.load_checkpoint(tmp_path / "ckpt", "t", model=loaded) == {"step": 3}
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    # The inspection command reads the same folder without executing anything either.
    info = subprocess.run(
        [sys.executable, "-m", "nxd_ckpt.cli", "info", str(tmp_path / "ckpt"), "--verify"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert info.returncode == 0, info.stderr


def _nxd_layout(tmp_path: Path, weights: Any, *, user_content: Any = None) -> Path:
    tag = tmp_path / "nxd" / "t"
    (tag / "model").mkdir(parents=True)
    torch.save(weights, tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    if user_content is not None:
        torch.save(user_content, tag / "user_content.pt")  # as NxD writes it
    for name in ("checkpoint", "done"):
        (tag / name).write_text("1")
    return tag


def test_nxd_weights_that_run_code_are_refused_even_with_allow_pickle(
    tmp_path: Path, marker: Path
) -> None:
    tag = _nxd_layout(tmp_path, _weights_with_payload(marker))
    for allow in (False, True):
        with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only load failed"):
            nxd_ckpt.load_checkpoint(tag.parent, "t", model=_model(), allow_pickle=allow)


def test_nxd_pickled_state_needs_allow_pickle(tmp_path: Path, marker: Path) -> None:
    tag = _nxd_layout(tmp_path, _model().state_dict(), user_content=_Payload(marker))
    torch.save(_Payload(marker), tag / "scheduler.pt")
    model = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), 0.1), 1)
    with pytest.raises(PermissionError, match=r"scheduler\.pt is a pickle .*allow_pickle=True"):
        nxd_ckpt.load_checkpoint(tag.parent, "t", model=model, scheduler=scheduler)
    # Without allow_pickle the pickled user content is not read (nothing returned).
    assert nxd_ckpt.load_checkpoint(tag.parent, "t", model=model) is None


def test_nxd_user_content_is_read_with_allow_pickle(tmp_path: Path) -> None:
    tag = _nxd_layout(tmp_path, _model().state_dict(), user_content={"step": 7})
    content = nxd_ckpt.load_checkpoint(tag.parent, "t", model=_model(), allow_pickle=True)
    assert content == {"step": 7}


def _hf_folder(tmp_path: Path, marker: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    torch.save(_weights_with_payload(marker), folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def test_hf_folder_with_pytorch_model_bin_is_refused(tmp_path: Path, marker: Path) -> None:
    folder = _hf_folder(tmp_path, marker)
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        nxd_ckpt.load_hf_checkpoint(_model(), folder)
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        legacy.load(folder, _model(), sharded=False)


def test_hf_refusal_names_the_pickled_bin(tmp_path: Path, marker: Path) -> None:
    folder = _hf_folder(tmp_path, marker)
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin.*pickle"):
        nxd_ckpt.load_hf_checkpoint(_model(), folder)


def test_legacy_pt_loader_uses_weights_only(tmp_path: Path, marker: Path) -> None:
    folder = tmp_path / "legacy" / "tp_rank_00_pp_rank_00"
    folder.mkdir(parents=True)
    torch.save(_weights_with_payload(marker), folder / "checkpoint.pt")
    with pytest.raises(pickle.UnpicklingError):
        legacy.load(tmp_path / "legacy", _model())
    with pytest.raises(pickle.UnpicklingError):
        legacy.load(folder / "checkpoint.pt", _model(), sharded=False)
