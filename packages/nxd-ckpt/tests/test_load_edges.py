"""Edges of load where a wrong result would be silent: dtypes, odd ZeRO-1 shard sizes, a load
racing a save of the same tag.

* A tag's tensors load into a model of another dtype as ``load_state_dict`` casts them: an
  exact cast (bf16 -> fp32) bitwise and quietly; a narrowing one (fp32 -> bf16, bf16 -> fp16:
  fine-tuning an fp32 tag in bf16) rounds to nearest, and one warning names each such tensor
  and both dtypes.
* ZeRO-1 state of 43 elements saved at DP = 2 (one padding element) loads at DP = 1 and
  DP = 3 (two), shard edges inside parameters, and saved again there holds the moments of
  one process's AdamW bitwise: padding is never read as state and never written.
* A process loading a tag while another re-saves it gets either a whole checkpoint (all old
  or all new values) or a clear error, never a mix.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_ckpt.load._load_model import exact_cast
from nxd_ckpt.load._reader import CheckpointReader
from nxd_state.testing import run_distributed


def _model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).to(dtype)


# dtype -----------------------------------------------------------------------------------


def test_exact_casts() -> None:
    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    for stored, target in ((bf16, f32), (f16, f32), (f32, f64), (bf16, f64), (f32, f32)):
        assert exact_cast(stored, target), (stored, target)
    for stored, target in ((f32, bf16), (f32, f16), (bf16, f16), (f16, bf16), (f64, f32)):
        assert not exact_cast(stored, target), (stored, target)
    assert exact_cast(torch.int32, torch.int64)
    assert exact_cast(torch.int16, f32)
    assert not exact_cast(torch.int64, torch.int32)
    assert not exact_cast(torch.int32, f32)
    assert not exact_cast(f32, torch.int64)
    assert exact_cast(torch.bool, torch.int8)


def test_a_bf16_checkpoint_loads_into_an_fp32_model_exactly(tmp_path: Path) -> None:
    saved = _model(torch.bfloat16)
    save_checkpoint(tmp_path, "t", model=saved)
    loaded = _model(torch.float32, seed=1)
    load_checkpoint(tmp_path, "t", model=loaded)
    for (name, want), got in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert got.dtype == torch.float32
        assert torch.equal(got, want.float()), name


@pytest.mark.parametrize(
    ("stored", "target"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)],
)
def test_a_narrowing_cast_rounds_and_names_the_tensors(
    tmp_path: Path, stored: torch.dtype, target: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _model(stored)
    save_checkpoint(tmp_path, "t", model=saved)
    loaded = _model(target, seed=1)
    with caplog.at_level("WARNING", logger="nxd_ckpt"):
        load_checkpoint(tmp_path, "t", model=loaded)
    for (name, want), got in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert got.dtype == target
        assert torch.equal(got, want.to(target)), name  # torch's round to nearest even
    have, want_name = str(stored).removeprefix("torch."), str(target).removeprefix("torch.")
    (line,) = [r.getMessage() for r in caplog.records if "rounded" in r.getMessage()]
    assert "4 tensor(s) rounded to the model's dtype" in line
    assert f"0.weight: checkpoint {have}, model {want_name}" in line


def test_an_exact_cast_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_checkpoint(tmp_path, "t", model=_model(torch.bfloat16))
    with caplog.at_level("WARNING", logger="nxd_ckpt"):
        load_checkpoint(tmp_path, "t", model=_model(torch.float32, seed=1))
    assert not [r for r in caplog.records if "rounded" in r.getMessage()]


# ZeRO-1 at a DP degree that does not divide the parameters --------------------------------


def _odd_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))  # 43 elements: prime


def _odd_step(model: nn.Module, optimizer: Any, step: int) -> None:
    """One step on the same batch on every rank: the DP average of equal gradients is exact."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _zero1(tp: int) -> tuple[nn.Module, Any]:
    import nxd_state
    from nxd_optim import build_optimizer

    if nxd_state.model_parallel_is_initialized():
        nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = _odd_model()
    config = {"zero_one_enabled": True, "grad_clipping": False}
    return model, build_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-2)


def zero1_dp2_to_dp1_and_back(path: str) -> dict[str, torch.Tensor]:
    """Train 2 steps at DP=2 (shards of 22: 44 = 43 + 1 padding), save; load at DP=1 (TP=2
    replicas, one unpadded shard of 43), save; load that at DP=2 again and save; return the
    parameters loaded last."""
    model, optimizer = _zero1(tp=1)
    for step in (0, 1):
        _odd_step(model, optimizer, step)
    save_checkpoint(path, "dp2", model=model, optimizer=optimizer)
    model, optimizer = _zero1(tp=2)
    load_checkpoint(path, "dp2", model=model, optimizer=optimizer)
    save_checkpoint(path, "dp1", model=model, optimizer=optimizer)
    model, optimizer = _zero1(tp=1)
    load_checkpoint(path, "dp1", model=model, optimizer=optimizer)
    save_checkpoint(path, "back", model=model, optimizer=optimizer)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def zero1_dp3(path: str) -> dict[str, torch.Tensor]:
    """Load ``dp2`` at DP=3 (shards of 15: 45 = 43 + 2 padding, edges inside parameters)
    and save it; return the loaded parameters."""
    model, optimizer = _zero1(tp=1)
    load_checkpoint(path, "dp2", model=model, optimizer=optimizer)
    save_checkpoint(path, "dp3", model=model, optimizer=optimizer)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _stored_optimizer(tag: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(tag) as reader:
        names = reader.index.names("optimizer")
        return {name: reader.read_full("optimizer", name) for name in names}


def test_zero1_moments_round_trip_through_padded_shards(tmp_path: Path) -> None:
    model = _odd_model()  # the reference: plain AdamW in one process, the same two steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (0, 1):
        _odd_step(model, optimizer, step)
    names = dict(model.named_parameters())
    loaded = run_distributed(zero1_dp2_to_dp1_and_back, 2, str(tmp_path))
    loaded += run_distributed(zero1_dp3, 3, str(tmp_path))
    for rank in loaded:
        for name, value in rank.items():
            assert torch.equal(value, names[name]), name
    for tag in ("dp2", "dp1", "back", "dp3"):
        stored = _stored_optimizer(tmp_path / tag)
        for name, param in names.items():
            for key in ("exp_avg", "exp_avg_sq"):
                got = stored[f"{name}/{key}"]
                assert torch.equal(got, optimizer.state[param][key]), (tag, name, key)


# A load racing a save of the same tag -----------------------------------------------------


def load_from(paths: list[str]) -> dict[str, Any]:
    """Load tag ``t`` from ``paths[rank]`` into a model of 7s; the error and whether the
    model kept its 7s."""
    import torch.distributed as dist

    model = _model(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(7.0)
    try:
        load_checkpoint(paths[dist.get_rank()], "t", model=model)
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    untouched = all(bool(torch.all(p == 7.0)) for p in model.parameters())
    return {"error": error, "untouched": untouched}


def _two_saves(tmp_path: Path) -> tuple[Path, Path]:
    """Tag ``t`` in ``old`` and, in ``new``, the same tag saved again over a copy of it: what
    two ranks see when a save commits into the tag between their reads of its index."""
    old, new = tmp_path / "old", tmp_path / "new"
    save_checkpoint(old, "t", model=_model(torch.float32, seed=1))
    shutil.copytree(old, new)
    save_checkpoint(new, "t", model=_model(torch.float32, seed=2))
    return old, new


def test_ranks_that_read_two_saves_of_a_tag_all_refuse(tmp_path: Path) -> None:
    old, new = _two_saves(tmp_path)
    same = run_distributed(load_from, 2, [str(old), str(old)])
    assert [r["error"] for r in same] == [None, None]  # a copy of the tag per rank: the same save
    results = run_distributed(load_from, 2, [str(old), str(new)], timeout=60)
    for result in results:
        assert result["error"] is not None, result
        assert result["untouched"], result
    assert "the tag changed while the ranks opened it" in results[1]["error"]
    (new / "t" / "index.json").unlink()  # a first save before its commit on one rank's view
    results = run_distributed(load_from, 2, [str(old), str(new)], timeout=60)
    for result in results:
        assert result["error"] is not None, result
        assert result["untouched"], result
