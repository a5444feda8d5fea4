"""Save -> load at the same degrees on 2 and 4 gloo ranks: training resumes bitwise.

For each layout a tiny GPT (nxd_ckpt.testing) trains 2 steps, saves, trains a third; a model
built from another seed loads the checkpoint and trains the same third step: every
parameter must equal the uninterrupted run's bitwise (same computation, same order, CPU).
The 8-rank layout (2, 2, 2, ZeRO-1) is covered by test_reshard.py. Also: GQA projections
(K/V replicated by kv_size_multiplier, separate and fused) and a stride-2 column-parallel
layer reshard between TP = 4, 2 and 1; fp32 master weights of bf16 parameters survive
ZeRO-1 -> plain optimizer -> ZeRO-1 bitwise (the ZeRO-1 shards read through nxd_optim's public
``dtype_buckets``; NxDOptimizer's masters through its public ``master_weights_by_param()``,
whose layout is checked: a wrong one is refused).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_ckpt.testing import Degrees, build, full_state, train_step
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}


def _resume(path: str, degrees: Degrees) -> int:
    model, optimizer = build(degrees)
    for step in (0, 1):
        train_step(model, optimizer, step)
    save_checkpoint(path, str(degrees), model=model, optimizer=optimizer)
    train_step(model, optimizer, 2)
    expected = full_state(model)
    model, optimizer = build(degrees, seed=99)
    load_checkpoint(path, str(degrees), model=model, optimizer=optimizer)
    train_step(model, optimizer, 2)
    got = full_state(model)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, **EXACT, msg=f"{degrees}: {name}")
    return len(expected)


def round_trips(path: str, layouts: list[tuple[int, int, int, bool]]) -> list[int]:
    return [_resume(path, Degrees(*layout)) for layout in layouts]


def test_two_rank_layouts_resume_bitwise(tmp_path: Path) -> None:
    layouts = [(2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, True), (1, 1, 2, False)]
    counts = run_distributed(round_trips, 2, str(tmp_path), layouts)
    # Every parameter compared (TinyGPT, 4 layers: 69); at PP=2 the two stages share them.
    assert [c for i, c in enumerate(counts[0]) if i != 1] == [69, 69, 69]
    assert counts[0][1] + counts[1][1] == 69


def test_four_rank_layouts_resume_bitwise(tmp_path: Path) -> None:
    layouts = [(2, 2, 1, False), (2, 1, 2, True), (1, 1, 4, True)]
    counts = run_distributed(round_trips, 4, str(tmp_path), layouts)
    assert counts[0][0] + counts[2][0] == 69  # ranks 0 and 2: TP rank 0 of stages 0 and 1
    assert counts[0][1:] == [69, 69]


# GQA and strided layers ----------------------------------------------------------------
HIDDEN, Q_SIZE, KV_SIZE, HEAD_DIM = 16, 16, 8, 4  # 4 query heads, 2 KV heads


class Projections(nn.Module):
    def __init__(self, tp: int, fuse: bool) -> None:
        super().__init__()
        from nxd_layers import (
            ColumnParallelLinear,
            GQAQKVColumnParallelLinear,
            get_kv_size_multiplier,
        )

        self.qkv = GQAQKVColumnParallelLinear(
            HIDDEN,
            [Q_SIZE, KV_SIZE],
            kv_size_multiplier=get_kv_size_multiplier(KV_SIZE // HEAD_DIM, tp),
            head_dim=HEAD_DIM,
            fuse_qkv=fuse,
            gather_output=True,
        )
        self.strided = ColumnParallelLinear(HIDDEN, 24, bias=False, stride=2, gather_output=True)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [*self.qkv(x), self.strided(x)]


def _outputs(tp: int, fuse: bool, seed: int, path: str, save: str | None, load: str | None):
    import nxd_state

    if nxd_state.model_parallel_is_initialized():
        nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    module = Projections(tp, fuse)
    if load is not None:
        load_checkpoint(path, load, model=module)
    if save is not None:
        save_checkpoint(path, save, model=module)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return [y.clone() for y in module(x)]


def gqa_and_stride(path: str) -> dict[str, list[torch.Tensor]]:
    out = {}
    for fuse in (False, True):
        tag = f"fuse{int(fuse)}"
        out[f"tp4 {tag}"] = _outputs(4, fuse, 0, path, f"{tag}-tp4", None)  # K/V replicated x2
        out[f"tp2 {tag}"] = _outputs(2, fuse, 1, path, None, f"{tag}-tp4")
        out[f"tp1 {tag}"] = _outputs(1, fuse, 2, path, f"{tag}-tp1", f"{tag}-tp4")
        out[f"tp4 back {tag}"] = _outputs(4, fuse, 3, path, None, f"{tag}-tp1")
        out[f"tp2 unloaded {tag}"] = _outputs(2, fuse, 1, path, None, None)
    return out


def test_gqa_replicas_fused_qkv_and_stride_reshard(tmp_path: Path) -> None:
    results = run_distributed(gqa_and_stride, 4, str(tmp_path))
    outputs = results[0]
    for fuse in ("fuse0", "fuse1"):
        reference = outputs[f"tp4 {fuse}"]
        for label in (f"tp2 {fuse}", f"tp1 {fuse}", f"tp4 back {fuse}"):
            for got, want in zip(outputs[label], reference):
                # gather_output concatenates per-rank matmuls of the same weights: each output
                # element is one dot product, computed in another blocking at another TP size;
                # fp32 dot products of 16 terms of O(1) agree to ~1e-6.
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=label)
        # The loads did the work: the same module built from its seed, unloaded, differs.
        unloaded = outputs[f"tp2 unloaded {fuse}"]
        assert all(not torch.allclose(a, b) for a, b in zip(unloaded, reference))


# fp32 master weights ---------------------------------------------------------------------
def _bf16_model_and_optimizer(zero1: bool, seed: int):
    from nxd_layers import ColumnParallelLinear, RowParallelLinear
    from nxd_optim import build_optimizer

    torch.manual_seed(seed)
    model = nn.Sequential(
        ColumnParallelLinear(8, 16, gather_output=False, dtype=torch.bfloat16),
        nn.GELU(),
        RowParallelLinear(16, 4, input_is_parallel=True, dtype=torch.bfloat16),
    )
    optimizer = build_optimizer(
        {"zero_one_enabled": zero1, "grad_clipping": False},
        torch.optim.AdamW,
        model.parameters(),
        mixed_precision_config={"use_master_weights": True, "use_master_weights_in_ckpt": True},
        lr=1e-2,
    )
    return model, optimizer


def masters_round_trip(path: str) -> None:
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)  # DP=2
    model, optimizer = _bf16_model_and_optimizer(zero1=True, seed=0)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).bfloat16()
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    masters = [m.clone() for m in optimizer.state_dict()["master_weights"]]
    save_checkpoint(path, "zero1", model=model, optimizer=optimizer)

    nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)  # DP=1, no ZeRO-1
    plain_model, plain = _bf16_model_and_optimizer(zero1=False, seed=1)
    load_checkpoint(path, "zero1", model=plain_model, optimizer=plain)
    for master, param in zip(plain.state_dict()["master_weights"], plain_model.parameters()):
        assert master.dtype == torch.float32
        assert torch.equal(master.bfloat16(), param)  # the bf16 params are the rounded masters
    save_checkpoint(path, "plain", model=plain_model, optimizer=plain)
    # NxDOptimizer's masters are checked loudly: an accessor giving a master of the wrong
    # shape is refused (on every rank) rather than saved.
    accessor = plain.master_weights_by_param
    plain.master_weights_by_param = lambda: {p: m[:1] for p, m in accessor().items()}
    with pytest.raises(RuntimeError, match="not a same-shaped floating-point master"):
        save_checkpoint(path, "broken", model=plain_model, optimizer=plain)
    del plain.master_weights_by_param

    nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model, optimizer = _bf16_model_and_optimizer(zero1=True, seed=2)
    load_checkpoint(path, "plain", model=model, optimizer=optimizer)
    for got, want in zip(optimizer.state_dict()["master_weights"], masters):
        assert torch.equal(got, want)  # fp32 bits kept through the plain optimizer
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)  # not bf16 values


def test_fp32_masters_survive_zero1_to_plain_and_back(tmp_path: Path) -> None:
    run_distributed(masters_round_trip, 2, str(tmp_path))
