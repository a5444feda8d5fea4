"""Corrupted checkpoints are found before any tensor is used, naming the file, on every rank.

A TP=2 model is saved on 2 ranks; the test then damages the tag (a truncated data file, one
flipped byte inside a tensor, a flipped byte in a file's header, a removed shard, an edited
index: a tensor's shape, a chunk's checksum, two chunks over the same rows, JSON cut short)
and loads it on 2 ranks into a model whose parameters were set to a sentinel. Each case
proves: ``load_checkpoint`` raises on **both** ranks (the rank that reads the damaged file
and its peer, so no rank trains on alone), the message names the damaged file, and no
parameter on any rank changed (nothing was copied in before the damage was found).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import run_distributed

TIMEOUT = 180.0


def _model(seed: int) -> torch.nn.Module:
    from nxd_layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        ColumnParallelLinear(64, 128, gather_output=False),
        RowParallelLinear(128, 64, input_is_parallel=True),
        ColumnParallelLinear(64, 32, gather_output=True),
    )


def save(root: str) -> None:
    import nxd_ckpt
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    nxd_ckpt.save_checkpoint(root, "t", model=_model(0))


def load_damaged(root: str) -> dict[str, Any]:
    import nxd_ckpt
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = _model(1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    try:
        nxd_ckpt.load_checkpoint(root, "t", model=model)
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    untouched = all(bool(torch.all(p == 7.0)) for p in model.parameters())
    return {"error": error, "untouched": untouched}


def _data_files(tag: Path) -> list[Path]:
    return sorted(tag.glob("data-*/*.safetensors"))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(tag: Path) -> str:
    path = _data_files(tag)[1]
    path.write_bytes(path.read_bytes()[:-100])
    return path.name


def _flip_tensor_byte(tag: Path) -> str:
    path = _data_files(tag)[0]
    _flip(path, path.stat().st_size - 5)  # inside the last tensor's bytes
    return path.name


def _flip_header_byte(tag: Path) -> str:
    path = _data_files(tag)[1]
    _flip(path, 20)  # inside the safetensors JSON header
    return path.name


def _remove_shard(tag: Path) -> str:
    path = _data_files(tag)[1]
    path.unlink()
    return path.name


def _index(tag: Path) -> tuple[Path, dict[str, Any]]:
    path = tag / "index.json"
    return path, json.loads(path.read_text())


def _edit_shape(tag: Path) -> str:
    path, index = _index(tag)
    index["tensors"]["model"]["2.weight"]["shape"][0] += 1
    path.write_text(json.dumps(index))
    return str(tag)  # the index is the tag's: the error names the tag folder or a file in it


def _edit_checksum(tag: Path) -> str:
    path, index = _index(tag)
    for record in index["tensors"]["model"].values():
        for chunk in record["chunks"]:
            chunk["crc32"] = [(c + 1) % 2**32 for c in chunk["crc32"]]
    path.write_text(json.dumps(index))
    return str(tag)  # the index is the tag's: the error names the tag folder or a file in it


def _overlap_chunks(tag: Path) -> str:
    """The second TP half of a weight moved half-way onto the first's rows (CRCs valid): the
    rows still add up over the whole tensor, but half of them twice and a quarter never."""
    path, index = _index(tag)
    _, second = index["tensors"]["model"]["0.weight"]["chunks"]
    second["offsets"][0] -= second["shape"][0] // 2
    path.write_text(json.dumps(index))
    return str(tag)


def _cut_index(tag: Path) -> str:
    path = tag / "index.json"
    path.write_text(path.read_text()[:-40])
    return str(tag)


DAMAGE = {
    "truncated": _truncate,
    "flipped-tensor-byte": _flip_tensor_byte,
    "flipped-header-byte": _flip_header_byte,
    "removed-shard": _remove_shard,
    "index-shape-edited": _edit_shape,
    "index-checksums-edited": _edit_checksum,
    "index-chunks-overlap": _overlap_chunks,
    "index-cut-short": _cut_index,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    run_distributed(save, 2, str(root), timeout=TIMEOUT)
    return root


def _load(saved: Path, tmp_path: Path, damage: str) -> tuple[str, list[dict[str, Any]]]:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    name = DAMAGE[damage](root / "t")
    return name, run_distributed(load_damaged, 2, str(root), timeout=TIMEOUT)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_an_error_naming_the_file_on_every_rank(
    saved: Path, tmp_path: Path, damage: str
) -> None:
    name, results = _load(saved, tmp_path, damage)
    for rank, result in enumerate(results):
        assert result["error"] is not None, (rank, damage, result)
        assert name in result["error"], (rank, damage, result)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_found_before_any_parameter_changes(
    saved: Path, tmp_path: Path, damage: str
) -> None:
    _, results = _load(saved, tmp_path, damage)
    for rank, result in enumerate(results):
        assert result["error"] is not None, (rank, damage, result)
        assert result["untouched"], (rank, damage, result)
