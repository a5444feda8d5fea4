"""Lightning at TP=2, PP=2 and TP=2 x PP=2 on an unmodified Hugging Face Llama equals the trainer
API on the same ranks (bitwise) and one process (within round-off).

The model is a stock ``LlamaForCausalLM`` built from a config: at TP > 1 ``NeuronLTModule.setup``
hands it to ``initialize_parallel_model``, which parallelizes it with nxd-trainer's HF
parallelizer (column / row / vocabulary-parallel layers, the parallel loss); nothing in the
model is written for nxd. One 4-rank spawn runs every layout, each twice: ``Trainer.fit`` with
``NeuronLTModule`` and ``NxDStrategy``, then the reference's trainer-API loop
(``initialize_parallel_model``, ``initialize_parallel_optimizer``, ``run_train``, ``step``) on the
same data and seed. The one-process runs train the unmodified model with torch's AdamW and
``clip_grad_norm_`` on the global batches.

Heavier variants (``-m slow``, one more spawn): TinyLM (a model written with nxd's TP layers,
NxD's own way) at TP=2 and TP=2 x PP=2, and the HF Llama at TP=2 with sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
STEPS, WORLD = 3, 4
# name -> (model, TP, PP, config extras): WORLD ranks each, so DP = WORLD / (TP * PP).
LAYOUTS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "hf_tp2": ("hf_llama", 2, 1, {}),
    "hf_pp2": ("hf_llama", 1, 2, {}),
    "hf_tp2pp2": ("hf_llama", 2, 2, {}),
}
SLOW_LAYOUTS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "tinylm_tp2": ("tiny_lm", 2, 1, {}),
    "tinylm_tp2pp2": ("tiny_lm", 2, 2, {}),
    "hf_tp2_sp": ("hf_llama", 2, 1, {"sequence_parallel": True}),
}
CASES = [pytest.param(name, id=name) for name in LAYOUTS] + [
    pytest.param(name, id=name, marks=pytest.mark.slow) for name in SLOW_LAYOUTS
]


def both_loops(layouts: dict[str, tuple[str, int, int, dict[str, Any]]]) -> dict[str, Any]:
    import nxd_state

    out: dict[str, Any] = {"rank": torch.distributed.get_rank()}
    for name, (model, tp, pp, extra) in layouts.items():
        lit = R.lightning_run(model, tp, pp, STEPS, world=WORLD, **extra)
        api = R.trainer_api_run(model, tp, pp, STEPS, **extra)
        state = nxd_state.get_parallel_state()
        out[name] = {
            "lightning": lit,
            "api": api,
            "tp_rank": state.tensor_parallel_rank,
        }
    return out


@pytest.fixture(scope="module")
def default_results() -> list[dict[str, Any]]:
    return run_distributed(both_loops, WORLD, LAYOUTS)


@pytest.fixture(scope="module")
def slow_results() -> list[dict[str, Any]]:
    return run_distributed(both_loops, WORLD, SLOW_LAYOUTS)


def _results(request: pytest.FixtureRequest, name: str) -> list[dict[str, Any]]:
    """The spawn that ran ``name`` (the slow one only starts when a slow case is selected)."""
    return request.getfixturevalue("default_results" if name in LAYOUTS else "slow_results")


def _layout(name: str) -> tuple[str, int, int, dict[str, Any]]:
    return LAYOUTS.get(name) or SLOW_LAYOUTS[name]


@pytest.mark.parametrize("name", CASES)
def test_lightning_equals_trainer_api(request: pytest.FixtureRequest, name: str) -> None:
    _, tp, _, _ = _layout(name)
    for rank in _results(request, name):
        run = rank[name]
        lit, api = run["lightning"], run["api"]
        # At TP > 1 the HF model went through the parallelizer (not replicated over TP).
        assert (lit["tp_layers"] > 0) == (tp > 1), f"rank {rank['rank']}: {lit['tp_layers']}"
        assert len(lit["losses"]) == STEPS
        assert lit["losses"] == api["losses"], f"rank {rank['rank']}"  # exact (R.EXACT)
        assert lit["params"].keys() == api["params"].keys()
        for key, value in lit["params"].items():
            torch.testing.assert_close(value, api["params"][key], **R.EXACT, msg=key)


def _shard(full: torch.Tensor, local: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's contiguous slice of ``full`` along the one dimension the shapes differ in
    (column / row / vocabulary-parallel layouts; the tiny Llama has 2 KV heads at TP=2 and a
    vocabulary divisible by 2, so no GQA replication or padding)."""
    if local.shape == full.shape:
        return full
    dims = [d for d in range(full.dim()) if local.shape[d] != full.shape[d]]
    assert len(dims) == 1, (local.shape, full.shape)
    assert local.shape[dims[0]] * tp == full.shape[dims[0]], (local.shape, full.shape)
    return full.chunk(tp, dim=dims[0])[tp_rank]


@pytest.mark.parametrize("name", CASES)
def test_lightning_equals_one_process(request: pytest.FixtureRequest, name: str) -> None:
    model, tp, pp, _ = _layout(name)
    results = _results(request, name)
    reference = R.single_process_run(model, STEPS, dp=WORLD // (tp * pp))
    holders = [r for r in results if R.held(r[name]["lightning"]["losses"])]
    # The loss exists on the last pipeline stage: half the ranks at PP=2.
    assert len(holders) == WORLD // pp
    for rank in holders:
        # R.TOL: fp32 re-association (TP-split matmul sums, micro-batch means) amplified by
        # three AdamW steps; a missing DP average or TP reduction moves the 2nd decimal.
        torch.testing.assert_close(
            torch.tensor(rank[name]["lightning"]["losses"]),
            torch.tensor(reference["losses"]),
            **R.TOL,
        )
    covered = set()
    for rank in results:
        run = rank[name]
        for key, value in run["lightning"]["params"].items():
            full = _shard(reference["params"][key], value, tp, run["tp_rank"])
            torch.testing.assert_close(value, full, **R.TOL, msg=key)
            covered.add(key)
    assert covered == set(reference["params"]), set(reference["params"]) - covered
