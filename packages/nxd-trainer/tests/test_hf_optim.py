"""An optimizer written down before parallelisation becomes the parallel model's: optimum-neuron's
``make_optimizer_constructor_lazy`` + ``optimizer_for_mp`` at TP=2 on Mistral (its K/V
projections become the GQA projection's ``weight_k`` / ``weight_v``).

Two param groups (weight decay on matrices only, another LR for norms) recorded lazily over
the original parameters, mapped with ``parameter_mapping(original_parameter_ids(...))``: after
2 AdamW steps every parameter equals the one-process AdamW with the same groups (rtol 1e-4 /
atol 1e-5, ``_recipe.TOL``'s reasoning); a regular optimizer maps to the same class and groups;
a lazy one refuses to step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    matrices = [p for n, p in model.named_parameters() if p.dim() > 1]
    vectors = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0, "lr": 3e-3},
    ]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for step in range(2):
        ids = H.batch(seed=40 + step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def lazy_optimizer() -> dict[str, Any]:
    import nxd_state
    from nxd_trainer.hf import (
        ParallelizersManager,
        make_optimizer_constructor_lazy,
        optimizer_for_mp,
        original_parameter_ids,
        parameter_mapping,
    )

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    reference = H.model("mistral")
    model = copy.deepcopy(reference)
    lazy = make_optimizer_constructor_lazy(torch.optim.AdamW)(_groups(model), lr=1e-2, eps=1e-4)
    regular = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
    ids = original_parameter_ids(model)
    try:
        lazy.step()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    mapping = parameter_mapping(ids, model)
    optimizer = optimizer_for_mp(lazy, mapping)
    rebuilt = parallelizer.optimizer_for_mp(regular, mapping)
    _train(model, optimizer)
    expected = torch.optim.AdamW(_groups(reference), lr=1e-2, eps=1e-4)
    _train(reference, expected)
    cfg = reference.config
    return {
        "refused": refused,
        "mapped": len(mapping),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "rebuilt": (type(rebuilt).__name__, [len(g["params"]) for g in rebuilt.param_groups]),
        "params": {
            parallelizer.hf_name(n): H.full(p, p.detach(), n, cfg)
            for n, p in model.named_parameters()
        },
        "expected": {n: p.detach() for n, p in reference.named_parameters()},
        "expected_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in expected.param_groups
        ],
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_lazy_optimizer_maps_to_the_parallel_model(
    rank: int, results: list[dict[str, Any]]
) -> None:
    result = results[rank]
    assert "lazy" in result["refused"]
    assert result["mapped"] == len(result["expected"])
    assert result["groups"] == result["expected_groups"]
    assert result["rebuilt"] == ("SGD", [len(g) for g in _group_sizes(result)])
    for name, value in result["params"].items():
        torch.testing.assert_close(
            value, result["expected"][name], **TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def _group_sizes(result: dict[str, Any]) -> list[list[str]]:
    matrices = [n for n, v in result["expected"].items() if v.dim() > 1]
    vectors = [n for n, v in result["expected"].items() if v.dim() <= 1]
    return [matrices, vectors]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(lazy_optimizer, 2)
