"""Lightning at TP=2, PP=2 and TP=2 x PP=2 equals the trainer API on the same ranks (bitwise) and
one process (within round-off).

One 4-rank spawn runs every layout, each twice: ``Trainer.fit`` with ``NeuronLTModule`` and
``NxDStrategy``, then the reference's trainer-API loop (``initialize_parallel_model``,
``initialize_parallel_optimizer``, ``run_train``, ``step``) on the same data and seed. The
one-process runs use the same recipe on the global batches.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import run_distributed


def load_recipe() -> Any:
    path = Path(__file__).with_name("_recipe.py")
    spec = importlib.util.spec_from_file_location("_nxd_lightning_recipe", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


R = load_recipe()
STEPS = 3
# (name, model, TP, PP): 4 ranks each, so DP = 4 / (TP * PP).
LAYOUTS = [("tp2", "tiny_lm", 2, 1), ("pp2", "hf_llama", 1, 2), ("tp2pp2", "tiny_lm", 2, 2)]


def both_loops(world: int) -> dict[str, Any]:
    import nxd_state

    out: dict[str, Any] = {"rank": torch.distributed.get_rank()}
    for name, model, tp, pp in LAYOUTS:
        lit = R.lightning_run(model, tp, pp, STEPS, world=world)
        api = R.trainer_api_run(model, tp, pp, STEPS)
        state = nxd_state.get_parallel_state()
        out[name] = {
            "lightning": lit,
            "api": api,
            "tp": tp,
            "tp_rank": state.tensor_parallel_rank,
            "dp": state.data_parallel_size,
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(both_loops, 4, world=4)


@pytest.mark.parametrize(("name", "model", "tp", "pp"), LAYOUTS)
def test_lightning_equals_trainer_api(results: list, name: str, model: str, tp: int, pp: int):
    for rank in results:
        run = rank[name]
        lit, api = run["lightning"], run["api"]
        assert len(lit["losses"]) == STEPS
        assert lit["losses"] == api["losses"], f"rank {rank['rank']}"  # exact (R.EXACT)
        assert lit["params"].keys() == api["params"].keys()
        for key, value in lit["params"].items():
            torch.testing.assert_close(value, api["params"][key], **R.EXACT, msg=key)


@pytest.mark.parametrize(("name", "model", "tp", "pp"), LAYOUTS)
def test_lightning_equals_one_process(results: list, name: str, model: str, tp: int, pp: int):
    dp = 4 // (tp * pp)
    reference = R.single_process_run(model, STEPS, dp)
    holders = [r for r in results if R.held(r[name]["lightning"]["losses"])]
    # The loss exists on the last pipeline stage: half the ranks at PP=2.
    assert len(holders) == 4 // pp
    for rank in holders:
        torch.testing.assert_close(
            torch.tensor(rank[name]["lightning"]["losses"]),
            torch.tensor(reference["losses"]),
            **R.TOL,
        )
    covered = set()
    for rank in results:
        run = rank[name]
        for key, value in run["lightning"]["params"].items():
            full = reference["params"][key]
            if value.shape != full.shape:  # a TP shard: find its dim
                dim = next(d for d in range(full.dim()) if value.shape[d] != full.shape[d])
                full = full.chunk(run["tp"], dim=dim)[run["tp_rank"]]
            torch.testing.assert_close(value, full, **R.TOL, msg=key)
            covered.add(key)
    assert covered == set(reference["params"]), set(reference["params"]) - covered
