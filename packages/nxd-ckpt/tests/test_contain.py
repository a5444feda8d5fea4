"""Integrity checks, tiling, the tag marker and retention, in one process.

The hostile-input suite (every attack of issue #23, with an audit of the paths each call
touches) is ``tests-reliability/test_hostile_checkpoints.py``; these are the library's own
units: ``verify_tag`` / ``newest_intact_tag``, the chunk tiling check, encoded JSON content,
which folders are tags and which retention may delete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import nxd_ckpt
from nxd_ckpt import FormatError, newest_intact_tag, save_checkpoint, verify_tag
from nxd_ckpt.format._boxes import flat_range_boxes
from nxd_ckpt.format._jsonstate import check_encoded, encode
from nxd_ckpt.format._tags import apply_num_kept, list_tags
from nxd_ckpt.format._validate import check_tiling


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _flip_last_byte(tag: Path) -> Path:
    path = next(tag.glob("data-*/*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def test_newest_intact_tag_falls_back_and_says_why(tmp_path: Path) -> None:
    for tag in ("s1", "s2", "s3"):
        save_checkpoint(tmp_path, tag, model=_model(), user_content={"tag": tag})
    found = newest_intact_tag(tmp_path)
    assert (found.tag, found.path, found.damaged) == ("s3", tmp_path / "s3", ())
    assert verify_tag(tmp_path, "s3") == sum(
        r.size for r in nxd_ckpt.read_index(tmp_path / "s3").files.values()
    )
    damaged_file = _flip_last_byte(tmp_path / "s3")
    (tmp_path / "s2" / "index.json").write_text("{")
    found = newest_intact_tag(tmp_path)
    assert found.tag == "s1"
    assert [d.tag for d in found.damaged] == ["s3", "s2"]
    assert "checksum mismatch" in found.damaged[0].problem
    assert damaged_file.name in found.damaged[0].problem
    assert "is not valid JSON" in found.damaged[1].problem
    # data=False checks the index, sizes and headers only: a flipped data byte passes.
    assert newest_intact_tag(tmp_path, data=False).tag == "s3"
    # The caller's candidates, oldest first (e.g. a job's step tags): the last is newest.
    assert newest_intact_tag(tmp_path, ["s3", "s1"]).tag == "s1"
    found = newest_intact_tag(tmp_path, ["s2", "s3"])
    assert found.tag is None
    assert [d.tag for d in found.damaged] == ["s3", "s2"]
    with pytest.raises(ValueError, match="plain folder name"):
        newest_intact_tag(tmp_path, ["../s1"])
    with pytest.raises(FormatError, match="checksum mismatch"):
        verify_tag(tmp_path, "s3")
    assert newest_intact_tag(tmp_path / "nowhere").tag is None


def test_tiling_accepts_real_layouts_and_refuses_gaps_and_overlaps() -> None:
    shape = [6, 10]
    columns = [([0, c], [6, 2]) for c in range(0, 10, 2)]  # a dim-1 (row-parallel) split
    check_tiling(shape, columns, "t")
    flat = [b for s in range(0, 60, 7) for b in flat_range_boxes((6, 10), s, min(s + 7, 60))]
    check_tiling(shape, [(list(b.offsets), list(b.shape)) for b in flat], "t")  # ZeRO-1 ranges
    check_tiling([], [([], [])], "t")
    with pytest.raises(FormatError, match="hold 48 elements but the tensor has 60"):
        check_tiling(shape, columns[:-1], "t")
    shifted = [*columns[:-1], ([0, 7], [6, 2])]  # overlaps its neighbour, leaves a gap
    with pytest.raises(FormatError, match="overlap"):
        check_tiling(shape, shifted, "t")
    with pytest.raises(FormatError, match="outside"):
        check_tiling(shape, [*columns[:-1], ([0, 9], [6, 2])], "t")
    with pytest.raises(FormatError, match="dimension"):
        check_tiling(shape, [([0], [60])], "t")


def test_encoded_content_forms_and_depth() -> None:
    tensors: dict[str, torch.Tensor] = {}
    value = {"a": [1, (2.0, float("nan")), torch.ones(2)], 3: torch.int8, "n": None}
    check_encoded(encode(value, tensors, "c", "x"), set(tensors), "c")
    for bad, words in (
        ({"__tensor__": "missing"}, "not stored"),
        ({"__dict__": [[1.5, 2]]}, "not a [key, value] pair"),
        ({"__dtype__": "float99"}, "unknown dtype"),
        ({"__float__": "x"}, "not a float"),
        ({"other": 1}, "not an encoded value"),
    ):
        with pytest.raises(FormatError, match=words.replace("[", r"\[")):
            check_encoded(bad, set(), "c")
    deep: list = []
    for _ in range(101):
        deep = [deep]
    with pytest.raises(TypeError, match="more than 100 levels"):
        encode(deep, {}, "c", "user_content")
    with pytest.raises(FormatError, match="more than 100"):
        check_encoded(deep, set(), "c")


def test_save_refuses_content_deeper_than_a_load_accepts(tmp_path: Path) -> None:
    deep: list = []
    for _ in range(120):
        deep = [deep]
    with pytest.raises(TypeError, match="nests containers more than 100 levels"):
        save_checkpoint(tmp_path, "t", model=_model(), user_content=deep)
    assert not (tmp_path / "t").exists()


def test_which_folders_are_tags_and_what_retention_deletes(tmp_path: Path) -> None:
    model = _model()
    save_checkpoint(tmp_path, "old", model=model)
    (tmp_path / "old" / "nxd-ckpt.json").unlink()  # written before the marker existed
    save_checkpoint(tmp_path, "odd", model=model)
    (tmp_path / "odd" / "nxd-ckpt.json").unlink()
    document = json.loads((tmp_path / "odd" / "index.json").read_text())
    document["format"] = "someone-else"
    (tmp_path / "odd" / "index.json").write_text(json.dumps(document))
    for tag in ("a", "b"):
        save_checkpoint(tmp_path, tag, model=model)
    etl = tmp_path / "etl"
    etl.mkdir()
    (etl / "done").write_text("1")
    (tmp_path / ".hidden").mkdir()
    marker = json.dumps({"format": "nxd-ckpt", "format_version": 1})
    (tmp_path / ".hidden" / "nxd-ckpt.json").write_text(marker)
    (tmp_path / "link").symlink_to(tmp_path / "a", target_is_directory=True)
    listed = [t.name for t in list_tags(tmp_path)]
    assert listed == ["old", "odd", "a", "b"]  # neither etl, .hidden nor the link
    removed = apply_num_kept(tmp_path, 1)
    assert removed == ["old", "a"]  # "odd" has no valid nxd-ckpt index: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "b", "etl", "link", "odd"]
    assert (tmp_path / "link").is_symlink()


def test_deletion_removes_done_first_and_the_marker_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nxd_ckpt.format import _tags

    for tag in ("a", "b"):
        save_checkpoint(tmp_path, tag, model=_model())
    removed: list[str] = []
    real_unlink = os.unlink

    def unlink(path: object, *args: object, **kwargs: object) -> None:
        removed.append(Path(str(path)).name)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_tags.os, "unlink", unlink)
    _tags.remove_tag(tmp_path / "a")
    assert removed[0] == "done"
    assert removed[-3:] == ["checkpoint", "index.json", "nxd-ckpt.json"]
    assert not (tmp_path / "a").exists()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "done").write_text("1")
    with pytest.raises(ValueError, match="not deleted"):
        _tags.remove_tag(tmp_path / "x")
    assert (tmp_path / "x" / "done").exists()


def test_remove_checkpoint_deletes_only_its_own_tags(tmp_path: Path) -> None:
    """The public deletion (used by nxd-lightning's retention): a tag nxd-ckpt wrote goes; a
    folder it did not write, a link, a file or a tag naming another folder stays."""
    folder = tmp_path / "ckpts"
    save_checkpoint(folder, "a", model=_model())
    outside = tmp_path / "outside"
    save_checkpoint(outside, "b", model=_model())
    tf = folder / "tf_model"
    tf.mkdir()
    (tf / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"')
    (folder / "last.ckpt").write_text("a file someone put here")
    (folder / "link").symlink_to(outside / "b", target_is_directory=True)

    assert nxd_ckpt.remove_checkpoint(folder, "a") is True
    assert not (folder / "a").exists()
    assert nxd_ckpt.remove_checkpoint(folder, "a") is False  # nothing there any more
    with pytest.raises(ValueError, match="not deleted"):
        nxd_ckpt.remove_checkpoint(folder, "tf_model")
    for tag in ("last.ckpt", "link", "../outside/b", str(outside / "b")):
        with pytest.raises((ValueError, NotADirectoryError)):  # a file is not a tag folder
            nxd_ckpt.remove_checkpoint(folder, tag)
    assert (tf / "checkpoint").exists()
    assert (folder / "last.ckpt").exists()
    assert (folder / "link").is_symlink()
    assert (outside / "b" / "done").exists()
