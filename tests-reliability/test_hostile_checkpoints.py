"""Hostile and careless checkpoint folders: contained, all or nothing, one clear error.

Every case of issue #23's lists, one process each (cheap): a module fixture saves a valid
checkpoint (two tags of a small model with AdamW, StepLR and user content holding a tensor),
each test copies it, edits it as an attacker or a careless user would, and calls the
library under :mod:`_audit` (Python's audit hooks: every path opened, listed, deleted or
renamed by any thread). Each case asserts

* the error: its type (nxd-ckpt's ``FormatError`` / ``ContainmentError`` or a ``ValueError``
  for an argument, never a raw ``KeyError``, ``ZeroDivisionError``, ``RecursionError``,
  ``AttributeError`` or ``SafetensorError``) and the words naming the file, the tensor and
  the problem;
* all or nothing: the model, the optimizer and the scheduler a failed load was given are
  exactly as before (parameters bitwise, optimizer state empty, scheduler state equal);
* containment: no path outside the checkpoint folder was opened, listed or deleted (and
  the planted victim outside it is intact).

The README's table lists the attacks and what each gets.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nxd_ckpt
from nxd_ckpt import ContainmentError, FormatError, RetentionWarning, legacy
from nxd_ckpt.cli import main as cli
from nxd_state.testing import load_sibling

audit = load_sibling(__file__, "_audit")

RAW = (KeyError, ZeroDivisionError, RecursionError, AttributeError, TypeError, IndexError)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _save(root: Path) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for tag in ("t1", "t2"):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        content = {"step": int(tag[1]), "ids": torch.arange(6) * int(tag[1])}
        nxd_ckpt.save_checkpoint(
            root, tag, model=model, optimizer=optimizer, scheduler=scheduler, user_content=content
        )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    _save(root)
    return root


@dataclass
class Case:
    """A copy of the saved checkpoint (``ckpt``), a victim outside it (``elsewhere``: the
    same tags, which no call may read or delete) and fresh objects to load into."""

    base: Path

    @property
    def ckpt(self) -> Path:
        return self.base / "ckpt"

    @property
    def elsewhere(self) -> Path:
        return self.base / "elsewhere"

    def index(self, tag: str = "t2") -> dict[str, Any]:
        return json.loads((self.ckpt / tag / "index.json").read_text())

    def write_index(self, document: Any, tag: str = "t2") -> None:
        (self.ckpt / tag / "index.json").write_text(json.dumps(document))

    def data_file(self, tag: str = "t2") -> Path:
        return next((self.ckpt / tag).glob("data-*/*.safetensors"))

    def content_name(self) -> str:
        return next(iter(self.index()["tensors"]["user_content"]))


@pytest.fixture
def case(saved: Path, tmp_path: Path) -> Case:
    shutil.copytree(saved, tmp_path / "ckpt")
    shutil.copytree(saved, tmp_path / "elsewhere")
    return Case(tmp_path)


class Targets:
    """A model, optimizer and scheduler to load into, and a check that nothing changed."""

    def __init__(self, scheduler: str = "step") -> None:
        self.model = _model(seed=5)
        if scheduler == "sgd":
            self.optimizer: Any = torch.optim.SGD(self.model.parameters(), lr=0.5)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.5)
        if scheduler == "lambda":
            self.scheduler: Any = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: 0.9**step
            )
        else:
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3)
        self.params = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.groups = [dict(g, params=None) for g in self.optimizer.param_groups]
        self.schedule = _comparable(self.scheduler.state_dict())

    def kwargs(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def assert_untouched(self) -> None:
        for name, value in self.model.state_dict().items():
            assert torch.equal(value, self.params[name]), f"model {name} changed"
        assert not self.optimizer.state, "optimizer state was loaded"
        assert [dict(g, params=None) for g in self.optimizer.param_groups] == self.groups
        assert _comparable(self.scheduler.state_dict()) == self.schedule, "scheduler changed"


def _comparable(state: dict[str, Any]) -> dict[str, Any]:
    return {k: repr(v) for k, v in state.items()}


def _assert_clear(error: BaseException, *words: str) -> None:
    assert not isinstance(error, RAW) or isinstance(error, ValueError), repr(error)
    assert "SafetensorError" not in type(error).__name__, repr(error)
    for word in words:
        assert word in str(error), (word, str(error))


def _refused(
    case: Case,
    call: Callable[[], Any],
    error: type[BaseException],
    *words: str,
) -> BaseException:
    """Run ``call`` under the audit: it raises ``error`` naming ``words``, and nothing
    outside the checkpoint folder was touched."""
    with audit.audit_paths(case.ckpt) as seen, pytest.raises(error) as caught:
        call()
    _assert_clear(caught.value, *words)
    assert seen.outside() == [], seen.outside()
    assert seen.touched(case.elsewhere) == []
    return caught.value


def _load_refused(
    case: Case, error: type[BaseException], *words: str, tag: str | None = "t2", **targets: Any
) -> Targets:
    objects = Targets(**targets)
    _refused(
        case,
        lambda: nxd_ckpt.load_checkpoint(case.ckpt, tag, **objects.kwargs()),
        error,
        *words,
    )
    objects.assert_untouched()
    return objects


# Reads outside the checkpoint folder ------------------------------------------------------


@pytest.mark.parametrize("tag", ["../elsewhere/t1", "/abs/t1", "t1/../../elsewhere/t1", ".."])
def test_a_tag_that_is_a_path_is_refused_by_every_entry_point(case: Case, tag: str) -> None:
    import neuronx_distributed.trainer as nxd_trainer_api

    if tag.startswith("/abs"):
        tag = str(case.elsewhere / "t1")
    words = ("plain folder name", repr(tag))
    _load_refused(case, ValueError, *words, tag=tag)
    objects = Targets()
    _refused(
        case,
        lambda: nxd_trainer_api.load_checkpoint(case.ckpt, tag, model=objects.model),
        ValueError,
        *words,
    )
    objects.assert_untouched()
    for call in (
        lambda: nxd_ckpt.read_user_content(case.ckpt, tag),
        lambda: nxd_ckpt.verify_tag(case.ckpt, tag),
        lambda: nxd_ckpt.export_hf(case.ckpt, case.base / "out", tag=tag, config={}),
    ):
        _refused(case, call, ValueError, *words)
    assert not (case.base / "out").exists()
    with audit.audit_paths(case.ckpt) as seen:
        assert cli(["info", str(case.ckpt), "--tag", tag]) == 1
    assert seen.touched(case.elsewhere) == []


def test_a_symlinked_tag_is_never_picked_and_refused_when_named(case: Case) -> None:
    newest = case.ckpt / "zz-newest"
    newest.symlink_to(case.elsewhere / "t2", target_is_directory=True)
    (case.elsewhere / "t2" / "done").write_text(str(10**19))  # "newer" than every tag
    with audit.audit_paths(case.ckpt) as seen:
        assert nxd_ckpt.read_user_content(case.ckpt)["step"] == 2  # t2 of ckpt, not the link
        target = _model(seed=3)
        nxd_ckpt.load_checkpoint(case.ckpt, model=target)
        assert nxd_ckpt.has_checkpoint(case.ckpt)
        assert nxd_ckpt.newest_intact_tag(case.ckpt).tag == "t2"
    assert seen.outside() == []
    assert seen.touched(case.elsewhere) == []
    _load_refused(case, ContainmentError, "zz-newest", "symbolic link", tag="zz-newest")
    _refused(
        case,
        lambda: nxd_ckpt.read_user_content(case.ckpt, "zz-newest"),
        ContainmentError,
        "symbolic link",
    )


@pytest.mark.parametrize("what", ["data-file", "data-folder", "index"])
def test_a_file_replaced_by_a_symlink_is_refused(case: Case, what: str) -> None:
    if what == "data-file":
        path = case.data_file()
        outside = case.data_file().relative_to(case.ckpt)
    elif what == "data-folder":
        path = case.data_file().parent
        outside = path.relative_to(case.ckpt)
    else:
        path = case.ckpt / "t2" / "index.json"
        outside = path.relative_to(case.ckpt)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    path.symlink_to(case.elsewhere / outside)
    _load_refused(case, ContainmentError, path.name, "symbolic link")
    _refused(case, lambda: nxd_ckpt.read_user_content(case.ckpt, "t2"), ContainmentError)
    _refused(case, lambda: nxd_ckpt.verify_tag(case.ckpt, "t2"), ContainmentError)


@pytest.mark.parametrize("name", ["../../elsewhere/t2/{rel}", "{abs}", "data-x/../../../{rel}"])
def test_index_file_names_outside_the_tag_are_refused(case: Case, name: str) -> None:
    document = case.index()
    (relative,) = document["files"]
    planted = case.elsewhere / "t2" / relative  # a valid file there: following it would load
    new = name.format(rel=relative, abs=planted)
    document["files"] = {new: document["files"][relative]}
    for records in document["tensors"].values():
        for record in records.values():
            for chunk in record["chunks"]:
                chunk["file"] = new
    case.write_index(document)
    _load_refused(case, ContainmentError, "leaves the folder", repr(new))
    _refused(case, lambda: nxd_ckpt.read_user_content(case.ckpt, "t2"), ContainmentError)
    _refused(case, lambda: nxd_ckpt.read_index(case.ckpt / "t2"), ContainmentError)


def _hf_folder(case: Case, weight_map_file: str) -> Path:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in _model(seed=1).state_dict().items()}
    victim = case.elsewhere / "hf"
    victim.mkdir()
    save_file(state, str(victim / "model-00001-of-00001.safetensors"))
    folder = case.ckpt / "hf"
    folder.mkdir()
    save_file(state, str(folder / "model-00001-of-00001.safetensors"))
    target = weight_map_file.format(abs=victim / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, target)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("target", ["../../elsewhere/hf/model-00001-of-00001.safetensors", "{abs}"])
def test_hf_weight_map_outside_the_folder_is_refused(case: Case, target: str) -> None:
    from nxd_trainer.hf._sources import FolderStore

    folder = _hf_folder(case, target)
    model = _model(seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _refused(case, lambda: nxd_ckpt.load_hf_checkpoint(model, folder), ContainmentError)
    _refused(case, lambda: legacy.load(folder, model, sharded=False), ContainmentError)
    _refused(case, lambda: FolderStore(folder), ContainmentError)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_hf_files_may_be_links_as_in_the_hugging_face_cache(case: Case) -> None:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in _model(seed=1).state_dict().items()}
    blobs = case.ckpt / "hub" / "blobs"
    snapshot = case.ckpt / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    save_file(state, str(blobs / "0123"))
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123")
    model = _model(seed=5)
    nxd_ckpt.load_hf_checkpoint(model, snapshot)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name])


def test_legacy_and_nxd_layout_links_are_refused(case: Case) -> None:
    legacy_root = case.ckpt / "legacy"
    legacy.save(_model().state_dict(), legacy_root)
    rank = legacy_root / "tp_rank_00_pp_rank_00"
    shutil.move(rank, case.elsewhere / "rank")
    rank.symlink_to(case.elsewhere / "rank", target_is_directory=True)
    _refused(
        case,
        lambda: legacy.load(legacy_root, _model(seed=2)),
        ContainmentError,
        "tp_rank_00_pp_rank_00",
    )
    tag = case.ckpt / "nxd" / "t"
    (tag / "model").mkdir(parents=True)
    torch.save(_model().state_dict(), case.elsewhere / "weights.pt")
    (tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").symlink_to(
        case.elsewhere / "weights.pt"
    )
    for marker in ("checkpoint", "done"):
        (tag / marker).write_text("1")
    (tag / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").write_bytes(b"")  # a real file
    model = _model(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _refused(
        case,
        lambda: nxd_ckpt.load_checkpoint(tag.parent, "t", model=model),
        ContainmentError,
        "dp_rank_00_tp_rank_00_pp_rank_00.pt",
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_xser_reference_that_names_a_path_is_refused(case: Case) -> None:
    module = types.ModuleType("torch_xla.utils.serialization")

    class TensorReference:
        def __init__(self, tid: object) -> None:
            self.tid = tid

    TensorReference.__module__ = module.__name__
    TensorReference.__qualname__ = "TensorReference"
    module.TensorReference = TensorReference  # type: ignore[attr-defined]
    names = ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization")
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = module if name == names[-1] else types.ModuleType(name)
    tag = case.ckpt / "nxd" / "t"
    file = tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    (tag / "model").mkdir(parents=True)
    try:
        torch.save({"0.weight": TensorReference("../../../../elsewhere/x")}, file)
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
    (file.parent / (file.name + ".tensors")).mkdir()
    torch.save(torch.zeros(8, 6), case.elsewhere / "x")
    for marker in ("checkpoint", "done"):
        (tag / marker).write_text("1")
    _refused(
        case,
        lambda: nxd_ckpt.load_checkpoint(tag.parent, "t", model=_model()),
        FormatError,
        "tensor id '../../../../elsewhere/x'",
    )


# Deletes outside the checkpoint folder, or of things that are not checkpoints ------------


def _save_more(root: Path, tag: str, keep: int) -> None:
    model = _model(seed=9)
    nxd_ckpt.save_checkpoint(root, tag, model=model, user_content={"step": 9}, num_kept_ckpts=keep)


def test_retention_never_follows_a_symlinked_tag(case: Case) -> None:
    link = case.ckpt / "aa-old"
    link.symlink_to(case.elsewhere / "t1", target_is_directory=True)
    before = sorted(p.relative_to(case.elsewhere) for p in case.elsewhere.rglob("*"))
    with audit.audit_paths(case.ckpt) as seen:
        _save_more(case.ckpt, "t3", keep=1)  # no error: the link is not a tag
    assert seen.outside() == []
    assert seen.touched(case.elsewhere) == []
    assert link.is_symlink()
    assert sorted(p.relative_to(case.elsewhere) for p in case.elsewhere.rglob("*")) == before
    assert sorted(p.name for p in case.ckpt.iterdir()) == ["aa-old", "t3"]
    assert nxd_ckpt.read_user_content(case.ckpt) == {"step": 9}


def test_retention_keeps_tensorflow_and_etl_folders(case: Case) -> None:
    tensorflow = case.ckpt / "tf_model"
    tensorflow.mkdir()
    (tensorflow / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-1"\n')
    (tensorflow / "model.ckpt-1.index").write_bytes(b"\x00" * 16)
    etl = case.ckpt / "etl-2024-01-01"
    etl.mkdir()
    (etl / "done").write_text("1")
    (etl / "part-0000.csv").write_text("a,b\n")
    for folder in (tensorflow, etl):
        for path in (*folder.iterdir(), folder):
            os.utime(path, ns=(10**9, 10**9))  # older than every tag
    with audit.audit_paths(case.ckpt) as seen:
        _save_more(case.ckpt, "t3", keep=1)
    deleted = {Path(p).name for e, p in seen.events if e in ("os.remove", "shutil.rmtree")}
    assert "part-0000.csv" not in deleted
    assert "model.ckpt-1.index" not in deleted
    assert sorted(p.name for p in case.ckpt.iterdir()) == ["etl-2024-01-01", "t3", "tf_model"]
    assert sorted(p.name for p in tensorflow.iterdir()) == ["checkpoint", "model.ckpt-1.index"]
    assert sorted(p.name for p in etl.iterdir()) == ["done", "part-0000.csv"]
    assert [t.name for t in nxd_ckpt.format._tags.list_tags(case.ckpt)] == ["t3"]


def test_a_retention_failure_is_a_warning_after_the_commit(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nxd_ckpt.format import _tags

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_tags.shutil, "rmtree", refuse)
    with pytest.warns(RetentionWarning, match=r"could not remove old checkpoint tag .*t[12]"):
        _save_more(case.ckpt, "t3", keep=1)
    assert nxd_ckpt.read_user_content(case.ckpt, "t3") == {"step": 9}
    assert nxd_ckpt.newest_intact_tag(case.ckpt).tag == "t3"


def test_saving_into_a_link_or_a_foreign_folder_is_refused(case: Case) -> None:
    (case.ckpt / "t3").symlink_to(case.elsewhere / "t1", target_is_directory=True)
    with pytest.raises(ContainmentError, match="symbolic link"):
        _save_more(case.ckpt, "t3", keep=1)
    foreign = case.ckpt / "results"
    foreign.mkdir()
    (foreign / "checkpoint").write_text("tensorflow")
    (foreign / "report.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"results exists and was not written by nxd-ckpt"):
        _save_more(case.ckpt, "results", keep=1)
    assert sorted(p.name for p in foreign.iterdir()) == ["checkpoint", "report.txt"]
    assert sorted(p.name for p in (case.ckpt).iterdir()) == ["results", "t1", "t2", "t3"]


# Silently wrong or half-applied loads ------------------------------------------------------


def _rewrite_file(case: Case, tensors: dict[str, torch.Tensor], tag: str = "t2") -> dict:
    """Replace the tag's data file by one holding ``tensors`` (key -> tensor), with the
    index's file record and chunk CRCs made consistent; returns the index document (not
    written) for further edits."""
    from nxd_ckpt.format._stfile import plan_file, write_planned

    path = case.data_file(tag)
    items = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
    plan = plan_file(items, {"format": "pt"})
    digest = write_planned(path, plan, [tensors[e.key].contiguous() for e in plan.entries])
    document = case.index(tag)
    relative = str(path.relative_to(case.ckpt / tag))
    record = document["files"][relative]
    record.update(size=digest.size, crc32=digest.crc32, header_crc32=digest.header_crc32)
    for records in document["tensors"].values():
        for entry in records.values():
            for chunk in entry["chunks"]:
                if chunk["key"] in digest.block_crcs:
                    chunk["crc32"] = digest.block_crcs[chunk["key"]]
    return document


def _stored(case: Case, tag: str = "t2") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(case.data_file(tag)))


def _split(case: Case, category: str, name: str) -> dict[str, Any]:
    """The tag with tensor ``name`` stored as two chunks (rows halves): a valid layout."""
    tensors = _stored(case)
    document = case.index()
    record = document["tensors"][category][name]
    (chunk,) = record["chunks"]
    whole = tensors.pop(chunk["key"])
    half = whole.shape[0] // 2
    tensors["a"], tensors["b"] = whole[:half].clone(), whole[half:].clone()
    first = dict(chunk, key="a", shape=[half, *whole.shape[1:]])
    second = dict(chunk, key="b", offsets=[half, *chunk["offsets"][1:]])
    second["shape"] = [whole.shape[0] - half, *whole.shape[1:]]
    record["chunks"] = [first, second]
    case.write_index(document)
    document = _rewrite_file(case, tensors)
    case.write_index(document)
    return document


def test_overlapping_chunks_are_refused_for_model_and_user_content(
    case: Case, capsys: pytest.CaptureFixture[str]
) -> None:
    document = _split(case, "model", "0.weight")
    loaded = _model(seed=4)
    nxd_ckpt.load_checkpoint(case.ckpt, "t2", model=loaded)  # the split layout is valid
    assert nxd_ckpt.verify_tag(case.ckpt, "t2") > 0
    document["tensors"]["model"]["0.weight"]["chunks"][1]["offsets"] = [0, 0]  # rows 0-3 twice
    case.write_index(document)
    _load_refused(case, FormatError, "'0.weight'", "do not tile")
    assert cli(["info", str(case.ckpt), "--tag", "t2", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out
    assert "do not tile" in out
    assert "all checksums match" not in out


def test_overlapping_user_content_chunks_never_return_heap_memory(case: Case) -> None:
    name = case.content_name()
    document = _split(case, "user_content", name)
    assert torch.equal(nxd_ckpt.read_user_content(case.ckpt, "t2")["ids"], torch.arange(6) * 2)
    document["tensors"]["user_content"][name]["chunks"][1]["offsets"] = [0]
    case.write_index(document)
    _refused(case, lambda: nxd_ckpt.read_user_content(case.ckpt, "t2"), FormatError, repr(name))
    _load_refused(case, FormatError, repr(name), "do not tile")


def test_a_stored_shape_other_than_the_index_is_refused(case: Case) -> None:
    tensors = _stored(case)
    key = case.index()["tensors"]["model"]["0.weight"]["chunks"][0]["key"]
    tensors[key] = tensors[key][:1].clone()  # one row where the index says 8 (CRCs consistent)
    tensors["pad"] = torch.zeros(42)  # the 7 missing rows' bytes: sizes consistent too
    case.write_index(_rewrite_file(case, tensors))
    _load_refused(case, FormatError, case.data_file().name, repr(key), "[1, 6]", "[8, 6]")


def test_an_unknown_user_content_dtype_is_refused_before_anything_changes(case: Case) -> None:
    document = case.index()
    name = case.content_name()
    document["tensors"]["user_content"][name]["dtype"] = "float99"
    case.write_index(document)
    _load_refused(case, FormatError, repr(name), "unknown dtype 'float99'")


def test_a_scheduler_or_optimizer_of_another_type_is_refused(case: Case) -> None:
    _load_refused(
        case, ValueError, "saved from StepLR, this scheduler is LambdaLR", scheduler="lambda"
    )
    _load_refused(case, ValueError, "saved from AdamW, this optimizer is SGD", scheduler="sgd")
    document = case.index()  # saved before the class was recorded: the scheduler rejects it
    document.pop("scheduler_class")
    case.write_index(document)
    objects = _load_refused(case, FormatError, "LambdaLR", "lr_lambdas", scheduler="lambda")
    assert objects.scheduler.get_last_lr() == [0.5]


def test_an_emptied_crc_list_or_zero_crc_rows_is_refused(case: Case) -> None:
    document = case.index()
    document["tensors"]["model"]["2.bias"]["chunks"][0]["crc32"] = []
    case.write_index(document)
    _load_refused(case, FormatError, "'2.bias'", "0 CRC-32s for 1 block(s)")
    document["tensors"]["model"]["2.bias"]["chunks"][0]["crc32"] = [1]
    document["tensors"]["model"]["2.bias"]["chunks"][0]["crc_rows"] = 0
    case.write_index(document)
    _load_refused(case, FormatError, "'2.bias'", "crc_rows must be >= 1, got 0")


def test_a_model_tensor_dtype_other_than_stored_is_refused(case: Case) -> None:
    document = case.index()
    document["tensors"]["model"]["0.weight"]["dtype"] = "int32"  # same size as float32
    case.write_index(document)
    _load_refused(case, FormatError, "stored as float32, the index says int32")


def test_a_flipped_byte_in_the_newest_tag_falls_back_to_the_previous(case: Case) -> None:
    path = case.data_file()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    _load_refused(case, FormatError, path.name, "checksum mismatch")
    with audit.audit_paths(case.ckpt) as seen:
        found = nxd_ckpt.newest_intact_tag(case.ckpt)
    assert seen.outside() == []
    assert (found.tag, found.path) == ("t1", case.ckpt / "t1")
    ((bad),) = found.damaged
    assert bad.tag == "t2"
    assert "checksum mismatch" in bad.problem
    assert path.name in bad.problem
    assert nxd_ckpt.newest_intact_tag(case.ckpt, ["t2"]).tag is None


# Unclear errors --------------------------------------------------------------------------


def _rewrite_header(case: Case, edit: Callable[[dict[str, Any]], bytes | dict]) -> str:
    """Replace the data file's safetensors header by ``edit(header)`` (a dict to serialise,
    or raw bytes), data unchanged, and make the index's size and header CRC agree, so the
    header itself is what a load must judge."""
    from nxd_ckpt.format._crc import crc32

    path = case.data_file()
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    body = edit(header)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    body += b" " * (-len(body) % 8)
    new = struct.pack("<Q", len(body)) + body + raw[8 + length :]
    path.write_bytes(new)
    document = case.index()
    relative = str(path.relative_to(case.ckpt / "t2"))
    document["files"][relative].update(size=len(new), header_crc32=crc32(new[: 8 + len(body)]))
    case.write_index(document)
    return path.name


def _bad_dtype(header: dict[str, Any]) -> dict[str, Any]:
    key = next(k for k in header if k.startswith("model/0.weight"))
    header[key]["dtype"] = "X99"
    return header


def _bad_offsets(header: dict[str, Any]) -> dict[str, Any]:
    key = next(k for k in header if k.startswith("model/0.weight"))
    header[key]["data_offsets"][1] += 10**9
    return header


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_bad_dtype, ["unknown dtype 'X99'"]),
        (_bad_offsets, ["data_offsets", "do not hold"]),
        (lambda header: b"{not json", ["header is not JSON"]),
        (lambda header: b"[1, 2]", ["header is not a JSON object"]),
    ],
    ids=["dtype", "offsets", "not-json", "not-object"],
)
def test_safetensors_header_problems_name_the_file(
    case: Case, edit: Callable[[dict[str, Any]], Any], words: list[str]
) -> None:
    name = _rewrite_header(case, edit)
    _load_refused(case, FormatError, name, *words)


def test_a_huge_shape_is_refused_before_any_allocation(case: Case) -> None:
    document = case.index()
    name = case.content_name()
    record = document["tensors"]["user_content"][name]
    record["shape"] = [2**40]
    record["chunks"][0]["shape"] = [2**40]
    case.write_index(document)
    words = (repr(name), "8796093022208 bytes")
    _refused(case, lambda: nxd_ckpt.read_user_content(case.ckpt, "t2"), FormatError, *words)
    _load_refused(case, FormatError, *words)


@pytest.mark.parametrize("depth", [150, 100_000])
def test_a_deeply_nested_index_is_refused(case: Case, depth: int) -> None:
    document = case.index()
    document["user_content"] = "@NEST@"
    nested = "[" * depth + "]" * depth
    text = json.dumps(document).replace('"@NEST@"', nested)
    (case.ckpt / "t2" / "index.json").write_text(text)
    words = "nested too deeply" if depth > 1000 else "nested more than 100 containers deep"
    _load_refused(case, FormatError, "index.json", words)
    _refused(case, lambda: nxd_ckpt.read_user_content(case.ckpt, "t2"), FormatError, words)


def test_an_index_that_is_a_list_is_refused(case: Case) -> None:
    case.write_index([1, 2, 3])
    _load_refused(case, FormatError, "index.json", "is a JSON list, not an object")


def test_the_checker_sees_a_read_outside(case: Case) -> None:
    """The audit itself: a read of the victim is reported (so an empty report means none)."""
    with audit.audit_paths(case.ckpt) as seen:
        (case.elsewhere / "t1" / "index.json").read_bytes()
        os.listdir(case.elsewhere)
    assert [event for event, _ in seen.outside()] == ["open", "os.listdir"]
