"""Stored parts (``nxd_checkpoint_parts``, :mod:`nxd_ckpt.parts`): a layer whose layout depends
on the degree stores its tensors under degree-independent names.

Units: a spec cut at part boundaries keeps every block's local box and shifts its global one;
bad declarations are refused with the numbers; a load picks the parts, their aliases, or the
tensor's own name (checkpoints written before the declaration).

On 4 ranks, an attention-like block of 2 query heads and 1 KV head, laid out as a GQA
projection (K/V replicated) at TP 2 or as three column-parallel Q/K/V layers at TP 1:

* fused GQA at TP 2 x DP 2 with ZeRO-1 (the flat shards cut the fused parameter mid-row) is
  stored as ``q_proj``/``k_proj``/``v_proj`` (no ``qkv_proj`` name, optimizer state too);
  the Q/K/V layers at TP 1 x DP 4 (plain AdamW) load it: parameters equal the GQA ones
  (gathered, replicas dropped) bitwise; saved again from there and loaded into the fused
  ZeRO-1 layout, every optimizer state tensor and parameter equals the original bitwise, so
  the mapping holds both ways for parameters and for plain and ZeRO-1 state;
* a checkpoint written before the declaration (``qkv_proj.weight_k`` …, unfused, ZeRO-1) loads
  into the declared layer at its degree (its own names) and into the Q/K/V layers at TP 1
  (their declared aliases), bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nxd_ckpt import CHECKPOINT_PARTS, StoredPart, load_checkpoint, read_index, save_checkpoint
from nxd_ckpt.format._boxes import Box
from nxd_ckpt.layout._model_tensors import LocalTensor, Part, declared_parts
from nxd_ckpt.layout._sharding import Block, ShardSpec, part_spec
from nxd_state.testing import run_distributed

HIDDEN, HEAD_DIM, Q_SIZE, KV_SIZE = 8, 4, 8, 4  # 2 query heads, 1 KV head
PROJ = (("q", "q_proj", Q_SIZE), ("k", "k_proj", KV_SIZE), ("v", "v_proj", KV_SIZE))


# Units -------------------------------------------------------------------------------------
def _spec() -> ShardSpec:
    """Local rows [0, 6) = global rows [2, 5) and [7, 10) of a (10, 3) tensor."""
    blocks = [Block(Box((0, 0), (3, 3)), (2, 0)), Block(Box((3, 0), (3, 3)), (7, 0), False)]
    return ShardSpec((10, 3), blocks, tp_replicated=False, info={"partition_dim": 0})


def test_part_spec_cuts_blocks_and_shifts_global_rows() -> None:
    part = part_spec(_spec(), 4, 4, "w")  # global rows [4, 8)
    assert part.global_shape == (4, 3)
    assert part.blocks == [
        Block(Box((2, 0), (1, 3)), (0, 0)),  # global row 4 = local row 2
        Block(Box((3, 0), (1, 3)), (3, 0), False),  # global row 7 = local row 3, a replica
    ]
    assert part_spec(_spec(), 0, 2, "w").blocks == []  # rows this rank does not hold
    with pytest.raises(ValueError, match=r"part rows \[8, 12\) are outside the global tensor's 10"):
        part_spec(_spec(), 8, 4, "w")


def test_declared_parts_are_checked_and_named_as_siblings() -> None:
    module = nn.Module()
    setattr(module, CHECKPOINT_PARTS, {"w": (StoredPart("a.weight", 4), StoredPart("b.weight", 6))})
    parts = declared_parts(module, "block.fused", "w", _spec())
    assert parts is not None
    assert [p.name for p in parts] == ["block.a.weight", "block.b.weight"]
    assert [p.spec.global_shape for p in parts] == [(4, 3), (6, 3)]
    assert parts[1].spec.info["stored_part_of"] == {"name": "block.fused.w", "row_offset": 4}
    assert declared_parts(module, "block.fused", "other", _spec()) is None
    setattr(module, CHECKPOINT_PARTS, {"w": (StoredPart("a.weight", 4), StoredPart("b.weight", 5))})
    with pytest.raises(ValueError, match=r"parts of \[4, 5\] rows do not add up to .* 10 rows"):
        declared_parts(module, "block.fused", "w", _spec())
    setattr(module, CHECKPOINT_PARTS, {"w": ("a.weight",)})
    with pytest.raises(TypeError, match=r"tuple of nxd_ckpt\.StoredPart"):
        declared_parts(module, "block.fused", "w", _spec())
    with pytest.raises(ValueError, match="rows must be a positive int"):
        StoredPart("a.weight", 0)


def test_a_load_reads_parts_aliases_or_the_own_name() -> None:
    spec = _spec()
    local = LocalTensor(
        "m.fused.w", torch.zeros(6, 3), spec, [Part("m.a", spec), Part("m.b", spec, ("m.old_b",))]
    )
    assert [n for n, _ in local.stored()] == ["m.a", "m.b"]
    assert [n for n, _ in local.stored_in({"m.a", "m.b", "m.fused.w"})] == ["m.a", "m.b"]
    assert [n for n, _ in local.stored_in({"m.a", "m.old_b"})] == ["m.a", "m.old_b"]
    assert [n for n, _ in local.stored_in({"m.fused.w", "m.a"})] == ["m.fused.w"]
    assert [n for n, _ in local.stored_in(set())] == ["m.a", "m.b"]  # reported missing


# Ranks -------------------------------------------------------------------------------------
class Block4(nn.Module):
    """Q, K, V of ``HIDDEN`` features: a GQA projection (TP 2: the KV head replicated on both
    ranks) or three column-parallel layers, with the declarations a parallelizer makes."""

    def __init__(self, gqa: bool, fuse: bool = False, declare: bool = True) -> None:
        super().__init__()
        from nxd_layers import ColumnParallelLinear, GQAQKVColumnParallelLinear

        if gqa:
            self.qkv_proj = GQAQKVColumnParallelLinear(
                HIDDEN, [Q_SIZE, KV_SIZE], kv_size_multiplier=2, head_dim=HEAD_DIM,
                fuse_qkv=fuse, gather_output=True,
            )  # fmt: skip
            if declare:
                parts: dict[str, Any] = {}
                for kind in ("weight", "bias"):
                    if fuse:
                        parts[f"{kind}_qkv"] = tuple(
                            StoredPart(f"{p}.{kind}", n) for _, p, n in PROJ
                        )
                    for part, proj, _ in PROJ if not fuse else ():
                        parts[f"{kind}_{part}"] = (StoredPart(f"{proj}.{kind}"),)
                setattr(self.qkv_proj, CHECKPOINT_PARTS, parts)
            return
        for part, proj, size in PROJ:
            layer = ColumnParallelLinear(HIDDEN, size, gather_output=True)
            aliases = {k: (StoredPart(f"{proj}.{k}", aliases=(f"qkv_proj.{k}_{part}",)),)
                       for k in ("weight", "bias")}  # fmt: skip
            setattr(layer, CHECKPOINT_PARTS, aliases)
            self.add_module(proj, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "qkv_proj"):
            return torch.cat(self.qkv_proj(x), dim=-1)
        return torch.cat([getattr(self, p)(x) for _, p, _ in PROJ], dim=-1)


def _canonical(block: Block4) -> dict[str, torch.Tensor]:
    """Q/K/V weights and biases, gathered over TP (all are row-sharded), K/V replicas dropped
    (the first copy of each row, by the layer's ``kv_replica_rows``)."""
    import nxd_state
    from nxd_state import collectives

    group = nxd_state.get_tensor_model_parallel_group()
    out = {}
    for kind in ("weight", "bias"):
        if hasattr(block, "qkv_proj"):
            layer = block.qkv_proj
            if layer.fuse_qkv:
                sizes = [layer.q_output_size_per_partition]
                sizes += [layer.kv_output_size_per_partition] * 2
                pieces = getattr(layer, f"{kind}_qkv").detach().split(sizes)
            else:
                pieces = tuple(getattr(layer, f"{kind}_{p}").detach() for p in "qkv")
            rows = layer.kv_replica_rows()
        else:
            pieces = tuple(getattr(getattr(block, p), kind).detach() for _, p, _ in PROJ)
            rows = list(range(KV_SIZE))
        for (part, proj, size), piece in zip(PROJ, pieces):
            full = collectives.all_gather(piece.contiguous(), group=group, dim=0)
            if part != "q":
                full = full[[rows.index(r) for r in range(size)]]
            out[f"{proj}.{kind}"] = full.clone()
    return out


def _setup(tp: int, zero1: bool, seed: int, **block: Any) -> tuple[Block4, Any]:
    import nxd_state
    from nxd_optim import build_optimizer

    if nxd_state.model_parallel_is_initialized():
        nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    model = Block4(tp > 1, **block)
    optimizer = build_optimizer(
        {"zero_one_enabled": zero1, "grad_clipping": False},
        torch.optim.AdamW,
        model.parameters(),
        lr=1e-2,
    )
    return model, optimizer


def _train(model: Block4, optimizer: Any) -> None:
    import nxd_state

    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(7))
    dp, rank = nxd_state.get_data_parallel_size(), nxd_state.get_data_parallel_rank()
    rows = x.shape[0] // dp
    model(x[rank * rows : (rank + 1) * rows]).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state dict, in order (ZeRO-1: this rank's shards)."""
    out: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append(value.detach().clone())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(optimizer.state_dict()["state"])
    return out


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert set(got) == set(want), where
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{where}: {name}")


def parts_across_layouts(path: str) -> None:
    # Fused GQA at TP 2 x DP 2, ZeRO-1: each rank's 12-row weight_qkv + 12-element bias are
    # 108 elements, cut into shards of 54 (mid-row, inside the K rows).
    model, optimizer = _setup(2, True, seed=0, fuse=True)
    _train(model, optimizer)
    saved, state = _canonical(model), _state_tensors(optimizer)
    save_checkpoint(path, "fused", model=model, optimizer=optimizer)
    index = read_index(Path(path) / "fused")
    names = {f"{p}.{k}" for _, p, _ in PROJ for k in ("weight", "bias")}
    assert set(index.category("model")) == names
    assert {n.rpartition("/")[0] for n in index.category("optimizer")} == names

    model, optimizer = _setup(1, False, seed=1)  # Q/K/V layers, TP 1 x DP 4, plain AdamW
    load_checkpoint(path, "fused", model=model, optimizer=optimizer)
    _equal(_canonical(model), saved, "fused GQA -> Q/K/V layers")
    save_checkpoint(path, "separate", model=model, optimizer=optimizer)

    model, optimizer = _setup(2, True, seed=2, fuse=True)
    load_checkpoint(path, "separate", model=model, optimizer=optimizer)
    _equal(_canonical(model), saved, "back to fused GQA")
    back = _state_tensors(optimizer)
    assert len(back) == len(state) > 0
    for got, want in zip(back, state):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg="ZeRO-1 state after the trip")

    # Before the declaration: unfused GQA stored under qkv_proj.weight_k ...
    model, optimizer = _setup(2, True, seed=3, declare=False)
    _train(model, optimizer)
    saved, state = _canonical(model), _state_tensors(optimizer)
    save_checkpoint(path, "old", model=model, optimizer=optimizer)
    assert "qkv_proj.weight_k" in read_index(Path(path) / "old").category("model")
    model, optimizer = _setup(2, True, seed=4)  # declared: reads its own names
    load_checkpoint(path, "old", model=model, optimizer=optimizer)
    _equal(_canonical(model), saved, "old names, same layout")
    for got, want in zip(_state_tensors(optimizer), state):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg="old names: optimizer state")
    model, optimizer = _setup(1, False, seed=5)  # Q/K/V layers: their aliases
    load_checkpoint(path, "old", model=model, optimizer=optimizer)
    _equal(_canonical(model), saved, "old names -> Q/K/V layers")


def test_stored_parts_across_layouts_and_optimizers(tmp_path: Path) -> None:
    run_distributed(parts_across_layouts, 4, str(tmp_path))
