"""Checkpoints under context and expert parallelism (2 gloo ranks).

* CP=2: both ranks hold the same weights (replicated over DP x CP), so one of them writes each
  file (before, both CP ranks named themselves DP rank 0 and wrote the same file at once); the
  folder loads back bitwise on both ranks and in one process.
* EP=2: ``save_checkpoint`` shards expert parameters over EP (test_expert_parallel.py). The
  legacy ``parallel_layers.save`` / ``load`` with ``master_dp_only=True`` (DP rank 0's folder
  per TP/PP rank) would keep EP rank 0's experts only: refused, naming the degree, before
  anything is written or read; with ``master_dp_only=False`` (a folder per DP rank) they
  round-trip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_state.testing import run_distributed


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _cp2_round_trip(path: str) -> dict[str, Any]:
    import nxd_state

    nxd_state.initialize_model_parallel(context_parallel_size=2)
    saved = _model(0)
    save_checkpoint(path, "cp2", model=saved)
    loaded = _model(1)  # other weights: only the load can fix them
    load_checkpoint(path, "cp2", model=loaded)
    files = sorted(p.name for p in (Path(path) / "cp2").rglob("*.safetensors"))
    return {"saved": saved.state_dict(), "loaded": loaded.state_dict(), "files": files}


def test_cp2_saves_one_replica_and_loads_back(tmp_path: Path) -> None:
    results = run_distributed(_cp2_round_trip, 2, str(tmp_path))
    for result in results:
        for name, value in result["saved"].items():
            torch.testing.assert_close(result["loaded"][name], value, rtol=0, atol=0)  # bytes
    assert results[0]["files"] == results[1]["files"]
    assert results[0]["files"]  # something was written
    one_process = _model(2)
    load_checkpoint(str(tmp_path), "cp2", model=one_process)  # no parallel state: CP=1
    for name, value in one_process.state_dict().items():
        torch.testing.assert_close(value, results[0]["saved"][name], rtol=0, atol=0)


def _ep2_legacy(path: str) -> dict[str, Any]:
    import nxd_state
    from nxd_ckpt import legacy

    nxd_state.initialize_model_parallel(expert_model_parallel_size=2)
    state = {"w": torch.full((2,), float(nxd_state.get_expert_model_parallel_rank()))}
    legacy.save(state, f"{path}/every_dp", master_dp_only=False)
    messages = []
    for call in (
        lambda: legacy.save(state, f"{path}/dp0"),
        lambda: legacy.load(f"{path}/every_dp"),
    ):
        with pytest.raises(NotImplementedError, match=r"expert_model_parallel_size=2") as error:
            call()
        messages.append(str(error.value))
    loaded = legacy.load(f"{path}/every_dp", model_key=None, master_dp_only=False)
    return {"messages": messages, "saved": state, "loaded": loaded}


def test_ep2_legacy_save_of_dp_rank_0_only_is_refused(tmp_path: Path) -> None:
    results = run_distributed(_ep2_legacy, 2, str(tmp_path))
    for result in results:
        assert all("master_dp_only=False" in message for message in result["messages"])
        torch.testing.assert_close(result["loaded"]["w"], result["saved"]["w"], rtol=0, atol=0)
    assert not (tmp_path / "dp0").exists()
