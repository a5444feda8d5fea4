"""The pieces without processes: box arithmetic, shard specs, the safetensors writer/reader,
JSON encoding, tag bookkeeping and the ``nxd-ckpt`` command."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nxd_ckpt import FormatError, load_checkpoint, save_checkpoint
from nxd_ckpt.cli import main as cli
from nxd_ckpt.format import ChunkRecord, FileRecord
from nxd_ckpt.format._boxes import Box, flat_range_boxes, linear_index
from nxd_ckpt.format._jsonstate import decode, encode
from nxd_ckpt.format._stfile import plan_file, write_planned
from nxd_ckpt.format._stread import FileReader
from nxd_ckpt.format._tags import apply_num_kept, list_tags
from nxd_ckpt.layout._context import RankContext
from nxd_ckpt.layout._sharding import spec_for_tensor
from nxd_ckpt.save._plan import build_plan
from nxd_layers import gqa_kv_replica_rows


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), ()])
def test_flat_ranges_are_contiguous_boxes_covering_the_range(shape: tuple[int, ...]) -> None:
    total = math.prod(shape)
    rng = random.Random(0)
    data = torch.arange(total).reshape(shape)
    for _ in range(50):
        start = rng.randrange(0, total + 1)
        end = rng.randrange(start, total + 1)
        boxes = flat_range_boxes(shape, start, end)
        assert len(boxes) <= 2 * max(len(shape), 1) - 1
        covered = []
        for box in boxes:  # in flat order, each contiguous: its elements are consecutive
            values = data[box.slices()].reshape(-1)
            first = linear_index(shape, box.offsets)
            assert values.tolist() == list(range(first, first + box.numel))
            covered += values.tolist()
        assert covered == list(range(start, end))


def test_box_intersection() -> None:
    a, b = Box((0, 2), (4, 4)), Box((3, 0), (5, 3))
    assert a.intersect(b) == Box((3, 2), (1, 1))
    assert a.intersect(Box((4, 0), (1, 1))) is None
    assert Box.whole((4, 6)).contains(a)


@pytest.mark.parametrize(("dim", "stride", "tp"), [(0, 1, 4), (1, 1, 2), (0, 2, 2), (1, 3, 2)])
def test_partition_specs_rebuild_the_global_tensor(dim: int, stride: int, tp: int) -> None:
    from nxd_layers import set_tensor_model_parallel_attributes, shard_for_rank

    full = torch.randn(12, 18)
    rebuilt = torch.full_like(full, float("nan"))
    for rank in range(tp):
        shard = shard_for_rank(full, dim, rank, tp, stride)
        set_tensor_model_parallel_attributes(shard, True, dim, stride)
        spec = spec_for_tensor(shard, tp_rank=rank, tp_size=tp)
        assert spec.global_shape == tuple(full.shape)
        for block in spec.blocks:
            rebuilt[block.global_box.slices()] = shard[block.local.slices()]
    assert torch.equal(rebuilt, full)


def _expert_shard(full: torch.Tensor, ep_rank: int, ep: int, tp_rank: int, tp: int) -> torch.Tensor:
    """EP rank ``ep_rank``'s experts of ``full`` (E, H, 2I), TP-split along dim 2 with
    stride 2 (gate and up halves), marked as ``nxd_layers.moe`` marks them."""
    from nxd_layers import set_tensor_model_parallel_attributes, shard_for_rank

    local = full.shape[0] // ep
    shard = shard_for_rank(full[ep_rank * local : (ep_rank + 1) * local], 2, tp_rank, tp, 2)
    set_tensor_model_parallel_attributes(shard, tp > 1, 2, 2)
    shard.expert_model_parallel = True  # type: ignore[attr-defined]
    shard.expert_partition_dim = 0  # type: ignore[attr-defined]
    shard.expert_model_parallel_size = ep  # type: ignore[attr-defined]
    return shard


@pytest.mark.parametrize(("ep", "tp"), [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_expert_specs_rebuild_the_all_experts_tensor(ep: int, tp: int) -> None:
    full = torch.randn(4, 3, 8)  # 4 experts, hidden 3, 2 x intermediate 4
    rebuilt = torch.full_like(full, float("nan"))
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            shard = _expert_shard(full, ep_rank, ep, tp_rank, tp)
            spec = spec_for_tensor(
                shard, tp_rank=tp_rank, tp_size=tp, ep_rank=ep_rank, ep_size=ep, local_name="w"
            )
            assert spec.global_shape == tuple(full.shape)
            assert spec.expert_parallel
            assert spec.info["expert_model_parallel_size"] == ep
            for block in spec.blocks:
                rebuilt[block.global_box.slices()] = shard[block.local.slices()]
    assert torch.equal(rebuilt, full)


def test_expert_spec_refuses_a_degree_other_than_the_marked_one() -> None:
    shard = _expert_shard(torch.randn(4, 3, 8), 0, 2, 0, 1)
    with pytest.raises(ValueError, match=r"marked expert_model_parallel_size=2.* is 1"):
        spec_for_tensor(shard, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, local_name="w")
    shard.expert_partition_dim = 1  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="expert_partition_dim=1"):
        spec_for_tensor(shard, tp_rank=0, tp_size=1, ep_rank=0, ep_size=2, local_name="w")


def _rank_context(layout: Any, rank: int) -> RankContext:
    """What ``current_context`` says on ``rank`` of ``layout`` (without processes)."""
    coords = layout.coordinates(rank)
    (group,) = [g for g in layout.data_context_parallel_groups() if rank in g]
    return RankContext(
        rank=rank,
        world_size=layout.world_size,
        tp_rank=coords.tp,
        tp_size=layout.tensor_parallel_size,
        pp_rank=coords.pp,
        pp_size=layout.pipeline_parallel_size,
        dp_rank=group.index(rank),
        dp_size=layout.data_context_parallel_size,
        local_rank=rank,
        distributed=True,
        ep_rank=layout.expert_model_parallel_rank(rank),
        ep_size=layout.expert_model_parallel_size,
        edp_rank=layout.expert_data_parallel_rank(rank),
        edp_size=layout.expert_data_parallel_size,
    )


@pytest.mark.parametrize(
    ("world", "tp", "cp", "ep"), [(4, 1, 1, 2), (8, 1, 1, 4), (8, 2, 1, 2), (8, 2, 2, 2)]
)
def test_each_expert_and_dense_box_is_written_by_exactly_one_rank(
    world: int, tp: int, cp: int, ep: int
) -> None:
    from nxd_state.layout import ParallelLayout

    layout = ParallelLayout(
        world_size=world,
        tensor_parallel_size=tp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    experts, dense = torch.randn(4, 3, 8), torch.randn(5)
    written: dict[str, list[Box]] = {"e": [], "d": []}
    for rank in range(world):
        ctx = _rank_context(layout, rank)
        replicated = dense.clone()
        replicated.tensor_model_parallel = False  # type: ignore[attr-defined]
        state = {"e": _expert_shard(experts, ctx.ep_rank, ep, ctx.tp_rank, tp), "d": replicated}
        for chunk in build_plan(ctx, model=state, save_rng=False).chunks:
            written[chunk.name].append(chunk.box)
    for name, full in (("e", experts), ("d", dense)):
        boxes = written[name]
        assert len(set(boxes)) == len(boxes), f"{name}: a box written twice"
        assert sum(box.numel for box in boxes) == full.numel(), f"{name}: not covered"


class _FakeGQA(nn.Module):
    """The attributes nxd-ckpt reads from a GQA QKV layer, with a chosen replication order."""

    def __init__(self, order: str, tp: int) -> None:
        super().__init__()
        self.output_sizes, self.kv_size_multiplier, self.fuse_qkv = [16, 4], 4, True
        self.tensor_parallel_size, self.kv_heads, self.head_dim = tp, 2, 2
        self.order = order

    def replicate(self, master: torch.Tensor) -> torch.Tensor:
        heads = master.reshape(2, 2, -1)
        if self.order == "interleave":  # [k0, k0, ..., k1, k1, ...]
            return heads.repeat_interleave(4, dim=0).reshape(-1, master.shape[1])
        return master.repeat(4, 1)  # NxD's [k0, k1, k0, k1, ...]


class _FakeNxdGQA(_FakeGQA):
    """nxd_layers' public map (head by head) or, without it, NxD's block-wise order."""

    def kv_replica_rows(self) -> list[int]:
        return gqa_kv_replica_rows(2, 2, 4)


@pytest.mark.parametrize("order", ["interleave", "repeat"])
def test_gqa_spec_maps_replicas_onto_the_unreplicated_projection(order: str) -> None:
    tp = 8
    module = _FakeNxdGQA(order, tp) if order == "interleave" else _FakeGQA(order, tp)
    q, k = torch.randn(16, 3), torch.randn(4, 3)
    replicated = module.replicate(k)
    rebuilt_q, rebuilt_k = torch.zeros(16, 3), torch.zeros(4, 3)
    primaries = 0
    for rank in range(tp):
        local = torch.cat(
            [q.chunk(tp)[rank], replicated.chunk(tp)[rank], replicated.chunk(tp)[rank]]
        )
        local.tensor_model_parallel = True
        spec = spec_for_tensor(
            local, tp_rank=rank, tp_size=tp, module=module, local_name="weight_qkv"
        )
        assert spec.global_shape == (24, 3)
        for block in spec.blocks:
            rows = block.global_box
            value = local[block.local.slices()]
            if rows.offsets[0] < 16:
                rebuilt_q[rows.slices()] = value
            elif rows.offsets[0] < 20:  # K rows; every replica must equal the original rows
                k_rows = slice(rows.offsets[0] - 16, rows.offsets[0] - 16 + rows.shape[0])
                assert torch.equal(value, k[k_rows])
                rebuilt_k[k_rows] = value
                primaries += rows.numel if block.primary else 0
    assert torch.equal(rebuilt_q, q)
    assert torch.equal(rebuilt_k, k)
    assert primaries == k.numel()  # each K element written by exactly one rank


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[FileRecord, dict]:
    plan = plan_file([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], {"format": "pt"})
    digest = write_planned(path, plan, [tensors[e.key] for e in plan.entries])
    record = FileRecord(digest.size, digest.crc32, digest.header_crc32, 0)
    chunks = {
        e.key: ChunkRecord(
            path.name,
            e.key,
            [0] * len(e.shape),
            list(e.shape),
            digest.block_crcs[e.key],
            e.crc_rows,
        )
        for e in plan.entries
    }
    return record, chunks


def test_written_files_are_safetensors_and_partial_reads_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    from nxd_ckpt.format import _stfile

    monkeypatch.setattr(_stfile, "CRC_BLOCK_BYTES", 64)  # many CRC blocks in a small tensor
    tensors = {
        "a": torch.randn(40, 8),
        "b": torch.arange(10, dtype=torch.int16),
        "c": torch.randn(3, 5).to(torch.bfloat16),
        "d": torch.tensor(3.5, dtype=torch.float64),
        "e": torch.tensor([True, False]),
    }
    path = tmp_path / "x.safetensors"
    record, chunks = _write(path, tensors)
    loaded = load_file(str(path))
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value)
    assert len(chunks["a"].crc32) == 20  # 2 rows of 32 bytes per 64-byte block
    reader = FileReader(path, record)
    box = Box((13, 2), (9, 3))
    assert torch.equal(reader.read(chunks["a"], box), tensors["a"][box.slices()])
    assert torch.equal(reader.read(chunks["d"], Box((), ())), tensors["d"])
    raw = bytearray(path.read_bytes())
    header_length = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8 : 8 + header_length])["a"]["data_offsets"][0]
    raw[8 + header_length + begin + 5 * 32 + 4] ^= 0x01  # one bit of row 5 of "a"
    path.write_bytes(bytes(raw))
    reader = FileReader(path, record)
    far = Box((20, 0), (4, 8))  # rows 20-23: other CRC blocks, still readable
    assert torch.equal(reader.read(chunks["a"], far), tensors["a"][far.slices()])
    with pytest.raises(FormatError, match=r"checksum mismatch in tensor 'a' \(rows 4..5\)"):
        reader.read(chunks["a"], Box((5, 7), (1, 1)))


def test_json_state_round_trip_and_refusals() -> None:
    value = {"a": [1, 2.5, float("nan")], 3: ("x", None, True), "t": torch.ones(2), "d": torch.int8}
    tensors: dict[str, torch.Tensor] = {}
    encoded = json.loads(json.dumps(encode(value, tensors, "v", "test")))
    decoded = decode(encoded, tensors)
    assert decoded["a"][:2] == [1, 2.5]
    assert math.isnan(decoded["a"][2])
    assert decoded[3] == ("x", None, True)
    assert decoded["d"] is torch.int8
    assert torch.equal(decoded["t"], torch.ones(2))
    with pytest.raises(TypeError, match=r"key \(1, 2\) at 'v'"):
        encode({(1, 2): 3}, {}, "v", "test")


def test_num_kept_removes_stale_incomplete_tags_but_keeps_newer_ones(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    marker = json.dumps({"format": "nxd-ckpt", "format_version": 1})
    (tmp_path / "old-broken").mkdir()  # an interrupted deletion: markers, no done
    (tmp_path / "old-broken" / "checkpoint").write_text("1")
    (tmp_path / "old-broken" / "nxd-ckpt.json").write_text(marker)
    (tmp_path / "old-foreign").mkdir()  # as old, but not nxd-ckpt's (a TensorFlow folder)
    (tmp_path / "old-foreign" / "checkpoint").write_text("1")
    for tag in ("a", "b", "c"):
        save_checkpoint(tmp_path, tag, model=model)
    (tmp_path / "new-broken").mkdir()  # an interrupted save, newer than every complete tag
    (tmp_path / "new-broken" / "checkpoint").write_text("1")
    (tmp_path / "new-broken" / "nxd-ckpt.json").write_text(marker)
    # Tags are ordered by the time recorded in their markers; the hand-made ones hold "1" (no
    # time), so they fall back to mtime, which on Linux ticks coarsely: pin both ends.
    first = min(int((tmp_path / t / "done").read_text()) for t in "abc")
    os.utime(tmp_path / "old-broken" / "checkpoint", ns=(first - 10**9, first - 10**9))
    os.utime(tmp_path / "new-broken" / "checkpoint", ns=(first + 10**12, first + 10**12))
    removed = apply_num_kept(tmp_path, 2)
    assert sorted(removed) == ["a", "old-broken"]
    assert (tmp_path / "old-foreign" / "checkpoint").exists()  # never recognised as a tag
    assert [(t.name, t.complete) for t in list_tags(tmp_path)] == [
        ("b", True),
        ("c", True),
        ("new-broken", False),
    ]


def test_cli_info_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    save_checkpoint(tmp_path / "ckpt", "step1", model=model, user_content={"step": 1})
    assert cli(["info", str(tmp_path / "ckpt"), "--tensors", "--verify"]) == 0
    text = capsys.readouterr().out
    assert "step1" in text
    assert "TP=1 PP=1 DP=1" in text
    assert "0.weight float32[8, 4]" in text
    assert "all checksums match" in text
    assert cli(["info", str(tmp_path / "ckpt"), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["newest_complete"][0]["categories"]["model"]["tensors"] == 4
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "custom"}))
    out = tmp_path / "hf"
    ids = '{"eos_token_id": 3}'
    args = ["export-hf", str(tmp_path / "ckpt"), str(out), "--config", str(config)]
    assert cli([*args, "--token-ids", ids]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    written = json.loads((out / "config.json").read_text())
    assert (written["eos_token_id"], written["use_cache"]) == (3, True)
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 3}
    assert cli(["info", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_host_slots_bound_the_holders() -> None:
    """``num_workers`` slots: a third holder waits until one of two is released (the slots are
    ``filelock`` locks, which the operating system frees when a holder dies)."""
    import threading
    import time

    from nxd_ckpt.format._slots import host_slot

    events: list[str] = []

    def third() -> None:
        with host_slot(2, 0, "third"):
            events.append("third")

    with host_slot(2, 0, "first"), host_slot(2, 1, "second"):
        waiter = threading.Thread(target=third)
        waiter.start()
        time.sleep(0.3)
        events.append("released")
    waiter.join(timeout=10)
    assert events == ["released", "third"]


class _CountedWalks(nn.Module):
    """A model that counts how often its tensors are enumerated (``state_dict`` and
    ``named_modules``: what a walk of the model calls on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.calls: dict[str, int] = {"state_dict": 0, "named_modules": 0}

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["state_dict"] += 1
        return super().state_dict(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["named_modules"] += 1
        return super().named_modules(*args, **kwargs)


def test_a_save_walks_the_model_once(tmp_path: Path) -> None:
    """The optimizer's parameter names come from the same walk of the model as the model's
    tensors: one ``state_dict`` and one ``named_modules`` call per save."""
    model = _CountedWalks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.b(model.a(torch.ones(2, 4))).sum().backward()
    optimizer.step()  # optimizer state to save
    model.calls.update(state_dict=0, named_modules=0)
    save_checkpoint(tmp_path, "t", model=model, optimizer=optimizer)
    assert model.calls == {"state_dict": 1, "named_modules": 1}
    fresh = _CountedWalks()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    load_checkpoint(tmp_path, "t", model=fresh, optimizer=fresh_optimizer)
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    torch.testing.assert_close(loaded, saved, rtol=0, atol=0)  # bitwise: a copy of the bytes


def test_the_shard_types_are_nxd_states() -> None:
    """nxd-ckpt's old names of the shard types are nxd_state.shards' objects (moved upstream)."""
    import nxd_state.shards
    from nxd_ckpt.format import _boxes
    from nxd_ckpt.layout import _context, _sharding

    assert _boxes.Box is nxd_state.shards.Box
    assert _boxes.flat_range_boxes is nxd_state.shards.flat_range_boxes
    assert _sharding.ShardSpec is nxd_state.shards.ShardSpec
    assert _sharding.Block is nxd_state.shards.Block
    assert _context.RankContext is nxd_state.shards.RankContext
