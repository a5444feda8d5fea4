"""Checkpoints under context and expert parallelism (2 gloo ranks).

* CP=2: both ranks hold the same weights (replicated over DP x CP), so one of them writes each
  file (before, both CP ranks named themselves DP rank 0 and wrote the same file at once); the
  folder loads back bitwise on both ranks and in one process.
* EP=2: expert parameters differ between the EP ranks of a DP group, which nxd-ckpt does not
  shard yet: saving is refused, naming the degree, before anything is written.
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


def _ep2_save(path: str) -> str:
    import nxd_state

    nxd_state.initialize_model_parallel(expert_model_parallel_size=2)
    with pytest.raises(NotImplementedError, match=r"expert_model_parallel_size=2") as error:
        save_checkpoint(path, "ep2", model=_model(0))
    return str(error.value)


def test_ep2_save_is_refused_before_writing(tmp_path: Path) -> None:
    messages = run_distributed(_ep2_save, 2, str(tmp_path))
    assert all("issue #30" in message for message in messages)
    assert not (tmp_path / "ep2").exists()
