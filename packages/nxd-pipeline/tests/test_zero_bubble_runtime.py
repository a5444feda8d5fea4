"""ZB-H1's runtime: weight-gradient passes pulled into waits for a receive, same gradients."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

import nxd_state
from nxd_pipeline import NxDPPModel
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import run_distributed

M = 4


def _weights_fill_waits() -> dict[str, Any]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    reference = TinyGPT(layers=2)
    ids = torch.randint(0, 64, (M, 8))
    out: dict[str, Any] = {}
    for fill in (False, True):
        model = NxDPPModel(
            copy.deepcopy(reference),
            transformer_layer_cls=Block,
            num_microbatches=M,
            pipeline_cuts=["h.0"],
            schedule="zb_h1",
        )
        runner = model._step_runner()
        runner.fill_waits = fill
        if model.pipeline_parallel_rank == 0:  # a slow first stage: rank 1 waits on every F
            for stage in runner.stages.values():
                stage.register_forward_pre_hook(lambda *_: time.sleep(0.1))
        model.run_train(input_ids=ids, labels=ids)
        assert model.timeline is not None
        out[f"order {fill}"] = [e.action for e in model.timeline.entries if e.compute]
        out[f"grads {fill}"] = {n: p.grad.clone() for n, p in model.local_named_parameters()}
        listed = model.schedule.compute_actions(model.pipeline_parallel_rank)
        out["list order"] = [str(a) for a in listed]
    return out


def test_weight_passes_run_while_waiting_on_a_receive_with_identical_gradients() -> None:
    results = run_distributed(_weights_fill_waits, 2)
    for rank, result in enumerate(results):
        # Every parameter's gradient is bitwise the list order's: W keep their relative order,
        # so each gradient sums its microbatches in the same order.
        assert result["grads True"].keys() == result["grads False"].keys()
        for name, grad in result["grads True"].items():
            assert torch.equal(grad, result["grads False"][name]), f"rank {rank}: {name}"
        assert result["order False"] == result["list order"]
        weights = [a for a in result["order True"] if "W" in a]
        assert weights == [a for a in result["list order"] if "W" in a]
    # Rank 1 (list: 1F0 1I0 1F1 1I1 1W0 1F2 ...) waits ~0.1 s for each activation from the
    # slow rank 0, and runs the next W, whose I is done, in that wait instead of idling.
    assert results[1]["list order"][:6] == ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2"]
    assert results[1]["order True"] == [
        "1F0", "1I0", "1W0", "1F1", "1I1", "1W1", "1F2", "1I2", "1W2", "1F3", "1I3", "1W3"
    ]  # fmt: skip
