"""Save and load in one process: what goes in comes out, and bad input fails clearly.

One process (no torch.distributed: a world of one) exercises the whole format: model,
optimizer, scheduler, user content and RNG round trips (bitwise), tag selection, markers,
``num_kept_ckpts``, checksums, strict key checks and the error messages.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import nxd_ckpt
from nxd_ckpt import FormatError, load_checkpoint, save_checkpoint


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _trained(steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = _model(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], dict):
            _assert_same_state(a[key], b[key])
        else:
            assert a[key] == b[key], key


def test_round_trip_model_optimizer_scheduler_user_content_rng(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    content = {"step": 2, "loss": [0.5, float("inf")], "ids": torch.arange(5), "pair": (1, "a")}
    torch.manual_seed(123)
    save_checkpoint(tmp_path, "step2", model, optimizer, scheduler, user_content=content)
    expected_draw = torch.rand(3)  # the RNG state saved is the one before this draw

    model2, optimizer2, scheduler2 = _fresh()
    torch.manual_seed(0)
    loaded = load_checkpoint(tmp_path, "step2", model2, optimizer2, scheduler2)
    assert torch.equal(torch.rand(3), expected_draw)  # RNG restored
    assert loaded.keys() == content.keys()
    assert torch.equal(loaded["ids"], content["ids"])
    assert loaded["loss"] == content["loss"]
    assert loaded["pair"] == content["pair"]
    _assert_same_state(model.state_dict(), model2.state_dict())
    _assert_same_state(optimizer.state_dict(), optimizer2.state_dict())
    assert scheduler2.state_dict() == scheduler.state_dict()


def test_files_are_plain_safetensors_and_json(tmp_path: Path) -> None:
    from safetensors import safe_open

    model, optimizer, _ = _trained()
    save_checkpoint(tmp_path, "t", model=model, optimizer=optimizer)
    tag = tmp_path / "t"
    names = {p.name for p in tag.iterdir() if p.is_file()}
    assert names == {"checkpoint", "done", "index.json", "nxd-ckpt.json"}
    marker = json.loads((tag / "nxd-ckpt.json").read_text())
    assert (marker["format"], marker["format_version"], marker["tag"]) == ("nxd-ckpt", 1, "t")
    index = nxd_ckpt.read_index(tag)
    assert index.format_version == nxd_ckpt.FORMAT_VERSION
    for relative in index.files:
        with safe_open(str(tag / relative), framework="pt") as handle:
            keys = set(handle.keys())
        assert "model/0.weight@0,0" in keys
    weight = index.tensors["model"]["0.weight"]
    assert weight.shape == [16, 6]
    assert weight.dtype == "float32"
    assert set(index.tensors["optimizer"]) >= {"0.weight/exp_avg", "0.weight/exp_avg_sq"}
    assert index.optimizer["scalars"]["0.weight"]["step"]["value"] == 2.0
    json.loads((tag / "index.json").read_text())  # plain JSON


def test_tag_none_loads_the_newest_complete_tag(tmp_path: Path) -> None:
    model, _, _ = _trained(1)
    save_checkpoint(tmp_path, "a", model=model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    save_checkpoint(tmp_path, "b", model=model)
    # A newer tag whose save never finished: started, no done.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "checkpoint").write_text("1")
    target = _model(seed=3)
    load_checkpoint(tmp_path, model=target)
    assert torch.equal(target[0].weight, model[0].weight)
    assert nxd_ckpt.has_checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match=r"tag 'c' .* is incomplete: it has no 'done'"):
        load_checkpoint(tmp_path, "c", model=target)


def test_num_kept_ckpts_keeps_the_newest(tmp_path: Path) -> None:
    model, _, _ = _trained(1)
    for name in ("s1", "s2", "s3", "s4"):
        save_checkpoint(tmp_path, name, model=model, num_kept_ckpts=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s3", "s4"]


def test_resave_into_a_tag_replaces_it_and_cleans_old_data(tmp_path: Path) -> None:
    model, _, _ = _trained(1)
    save_checkpoint(tmp_path, "t", model=model)
    first = nxd_ckpt.read_index(tmp_path / "t").save_id
    with torch.no_grad():
        model[0].weight.mul_(2)
    save_checkpoint(tmp_path, "t", model=model)
    second = nxd_ckpt.read_index(tmp_path / "t").save_id
    assert first != second
    assert [p.name for p in (tmp_path / "t").glob("data-*")] == [f"data-{second}"]
    target = _model(seed=3)
    load_checkpoint(tmp_path, "t", model=target)
    assert torch.equal(target[0].weight, model[0].weight)


def test_strict_lists_missing_and_unexpected_keys(tmp_path: Path) -> None:
    model, _, _ = _trained(1)
    save_checkpoint(tmp_path, "t", model=model)
    bigger = nn.Sequential(*_model(seed=1), nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \[4.bias, 4.weight\]"):
        load_checkpoint(tmp_path, "t", model=bigger)
    smaller = nn.Sequential(*list(_model(seed=1))[:2])
    with pytest.raises(ValueError, match=r"not in the model: \[3.bias, 3.weight\]"):
        load_checkpoint(tmp_path, "t", model=smaller)
    load_checkpoint(tmp_path, "t", model=smaller, strict=False)
    assert torch.equal(smaller[0].weight, model[0].weight)


def test_shape_mismatch_names_the_tensor(tmp_path: Path) -> None:
    model, _, _ = _trained(1)
    save_checkpoint(tmp_path, "t", model=model)
    other = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    expected = r"mismatch: \[0.weight: checkpoint \(16, 6\), model \(8, 6\)"
    with pytest.raises(ValueError, match=expected):
        load_checkpoint(tmp_path, "t", model=other, strict=False)


def test_bad_paths_and_arguments(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", model=model)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint tag under"):
        load_checkpoint(tmp_path, model=model)
    save_checkpoint(tmp_path, "t", model=model)
    with pytest.raises(FileNotFoundError, match=r"tag 'x' not found under .*tags: \['t'\]"):
        load_checkpoint(tmp_path, "x", model=model)
    with pytest.raises(ValueError, match=r"num_workers must be an int in \[1, 32\].*got 0"):
        save_checkpoint(tmp_path, "u", model=model, num_workers=0)
    with pytest.raises(ValueError, match="num_kept_ckpts must be None or an int >= 1"):
        save_checkpoint(tmp_path, "u", model=model, num_kept_ckpts=0)
    with pytest.raises(ValueError, match="plain folder name"):
        save_checkpoint(tmp_path, "../escape", model=model)
    content = {"handle": threading.Lock()}
    with pytest.raises(TypeError, match=r"the value at 'user_content.handle' is a _thread.lock"):
        save_checkpoint(tmp_path, "u", model=model, user_content=content)


def test_unwritable_folder_fails_early(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # a folder cannot be created under a file, even by root
    with pytest.raises(PermissionError, match=r"checkpoint path .*a-file/ckpt is not a writable"):
        save_checkpoint(blocker / "ckpt", "t", model=_model())


def _data_file(tag: Path) -> Path:
    return next(tag.glob("data-*/*.safetensors"))


def test_truncated_file_is_reported(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "t", model=_model())
    path = _data_file(tmp_path / "t")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(FormatError, match=r"has \d+ bytes, the index says \d+: truncated"):
        load_checkpoint(tmp_path, "t", model=_model(1))


def test_bit_flip_is_caught_by_the_checksum(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "t", model=_model())
    path = _data_file(tmp_path / "t")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # a bit of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="checksum mismatch in tensor"):
        load_checkpoint(tmp_path, "t", model=_model(1))


def test_damaged_optimizer_state_leaves_everything_untouched(tmp_path: Path) -> None:
    """The model is read before the optimizer; a damaged optimizer tensor must still be
    found before any model parameter, optimizer state or scheduler changes."""
    model, optimizer, scheduler = _trained()
    save_checkpoint(
        tmp_path,
        "t",
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        user_content={"t": torch.ones(2)},
    )
    index = json.loads((tmp_path / "t" / "index.json").read_text())
    name = next(n for n in sorted(index["tensors"]["optimizer"]) if n.endswith("exp_avg_sq"))
    chunk = index["tensors"]["optimizer"][name]["chunks"][0]
    path = tmp_path / "t" / chunk["file"]
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    begin = 8 + length + json.loads(bytes(data[8 : 8 + length]))[chunk["key"]]["data_offsets"][0]
    data[begin] ^= 0x20
    path.write_bytes(bytes(data))
    target, target_optimizer, target_scheduler = _fresh()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    scheduler_before = dict(target_scheduler.state_dict())
    with pytest.raises(FormatError, match=r"checksum mismatch in tensor"):
        load_checkpoint(
            tmp_path, "t", model=target, optimizer=target_optimizer, scheduler=target_scheduler
        )
    _assert_same_state(before, target.state_dict())
    assert not target_optimizer.state  # nothing loaded into the optimizer
    assert target_scheduler.state_dict() == scheduler_before


def test_unknown_format_version_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "t", model=_model())
    index_path = tmp_path / "t" / "index.json"
    document = json.loads(index_path.read_text())
    document["format_version"] = 99
    index_path.write_text(json.dumps(document))
    with pytest.raises(FormatError, match="format_version 99 is not supported"):
        load_checkpoint(tmp_path, "t", model=_model(1))


def test_a_planted_pickle_is_never_executed(tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "executed"

    class Bomb:
        def __reduce__(self):  # runs on unpickling
            return (Path.write_text, (marker, "boom"))

    save_checkpoint(tmp_path, "t", model=_model())
    tag = tmp_path / "t"
    for name in ("user_content.pt", "scheduler.pt", "model.pt"):
        (tag / name).write_bytes(pickle.dumps(Bomb()))
    (tag / "model").mkdir()
    (tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_bytes(pickle.dumps(Bomb()))
    load_checkpoint(tmp_path, "t", model=_model(1), scheduler=None)
    assert not marker.exists()


class _Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def test_tied_weights_are_stored_once_and_load_under_both_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tied = _Tied(tie=True)
    save_checkpoint(tmp_path, "t", model=tied)
    index = nxd_ckpt.read_index(tmp_path / "t")
    assert set(index.tensors["model"]) == {"embed.weight"}
    assert index.aliases["model"] == {"head.weight": "embed.weight"}
    untied = _Tied(tie=False)  # e.g. two pipeline stages: each name is its own parameter
    load_checkpoint(tmp_path, "t", model=untied)
    assert torch.equal(untied.embed.weight, tied.embed.weight)
    assert torch.equal(untied.head.weight, tied.embed.weight)
    save_checkpoint(tmp_path, "u", model=untied)  # both stored; a tied model loads it too
    again = _Tied(tie=True)
    load_checkpoint(tmp_path, "u", model=again)
    assert torch.equal(again.head.weight, tied.embed.weight)
