"""``initialize_parallel_model(cfg, lambda: LlamaForCausalLM.from_pretrained(folder))`` at
TP > 1 parallelises the Hugging Face model by itself: the sample's loop (AdamW through
``initialize_parallel_optimizer``, clipping at 0.5) at TP=2 with sequence parallelism, with
the model loaded eagerly or under ``lazy_load_for_parallelism``, and at TP=2 x PP=2 (with and
without sequence parallelism), follows
the one-process run of the unmodified model; ``parallelize_hf_models=False`` leaves the model
as returned (replicated on the TP ranks, no parallel layer).

Losses and every parameter after 2 steps: rtol 1e-4 / atol 1e-5 (``_recipe.TOL``: fp32
re-association amplified by AdamW); lazy and eager loading give bitwise-equal models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
TOL = {"rtol": 1e-4, "atol": 1e-5}
ADAMW = {"lr": 1e-2, "eps": 1e-4}
MAX_NORM, STEPS = 0.5, 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    H.model("llama").save_pretrained(path)
    return path


def _reference(folder: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        ids = H.batch(seed=30 + step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _from_pretrained(folder: str, lazy: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from nxd_trainer.hf import lazy_load_for_parallelism

    if not lazy:
        return AutoModelForCausalLM.from_pretrained(folder)
    with lazy_load_for_parallelism(tensor_parallel_size=2):
        return AutoModelForCausalLM.from_pretrained(folder)


def sample(folder: str, pp: int, sp: bool, lazy: bool, auto: bool = True) -> dict[str, Any]:
    import nxd_state
    import nxd_trainer as nxd
    from nxd_layers import BaseParallelLinear
    from nxd_trainer.hf import ParallelizersManager

    nxd_state.destroy_model_parallel()
    pipeline_config = None
    if pp > 1:
        pipeline_config = {
            "num_microbatches": 2,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["model.layers.0"],
        }
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline_config,
        optimizer_config={"zero_one_enabled": False, "max_grad_norm": MAX_NORM},
        sequence_parallel=sp,
        parallelize_hf_models=auto,
    )
    model = nxd.initialize_parallel_model(nxd_config, lambda: _from_pretrained(folder, lazy))
    parallel = any(isinstance(m, BaseParallelLinear) for m in model.modules())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), **ADAMW
    )
    losses = []
    for step in range(STEPS):
        ids = H.batch(seed=30 + step)
        loss = model.run_train(input_ids=ids, labels=ids)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    cfg = model.config
    parallelizer = ParallelizersManager.parallelizer_for_model("llama")
    return {
        "parallel": parallel,
        "losses": losses,
        "initial": initial,
        "params": {
            parallelizer.hf_name(n): H.full(p, p.detach(), n, cfg)
            for n, p in model.named_parameters()
        },
    }


def two_ranks(folder: str) -> dict[str, Any]:
    return {
        "eager": sample(folder, 1, True, False),
        "lazy": sample(folder, 1, True, True),
        "off": sample(folder, 1, False, False, auto=False),
    }


def _check(result: dict[str, Any], expected: dict[str, Any]) -> set[str]:
    if result["losses"][0] is not None:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(expected["losses"]), **TOL
        )
    for name, value in result["params"].items():
        torch.testing.assert_close(
            value, expected["params"][name], **TOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    return set(result["params"])


def test_trainer_parallelizes_hf_models_at_tp2_sp(folder: Path) -> None:
    expected = _reference(folder)
    for result in run_distributed(two_ranks, 2, str(folder)):
        assert result["eager"]["parallel"]
        assert result["lazy"]["parallel"]
        assert not result["off"]["parallel"]
        for name, value in result["eager"]["initial"].items():  # lazy == eager, bitwise
            torch.testing.assert_close(result["lazy"]["initial"][name], value, rtol=0, atol=0)
        for case in ("eager", "lazy", "off"):
            assert _check(result[case], expected) == set(expected["params"]), case


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_trainer_parallelizes_hf_models_at_tp2_pp2(folder: Path, sp: bool) -> None:
    """``sp``: sequence parallelism across the stages too (each rank sends its slice)."""
    expected = _reference(folder)
    results = run_distributed(sample, 4, str(folder), 2, sp, True)
    covered: set[str] = set()
    for result in results:
        assert result["parallel"]
        covered |= _check(result, expected)
    assert covered == set(expected["params"])
    assert sum(r["losses"][0] is not None for r in results) == 2  # the last stage's TP ranks
