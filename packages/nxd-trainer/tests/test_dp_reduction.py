"""Gradients are averaged over data parallelism exactly once per step, and the traffic counter
proves it: at PP=2 x DP=2 the DP all-reduce of one step moves exactly the local gradients'
bytes, Ψ_local · 4 (fp32), whoever does it, and accumulating micro-steps does not add any.

Without the trainer, NxDPPModel (averaging after each step) plus NxD's optimizer wrapper
(averaging again) moves 2 · Ψ_local · 4: the case shows the counter tells the two apart.
Gradient values: fp32, DP averages two half-batch means instead of one mean (round-off only);
same tolerance as the pipeline's own parity tests, rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed, run_named_checks

R = load_sibling(__file__, "_recipe")
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
PIPELINE = {
    "num_microbatches": 2,
    "pipeline_cuts": ["blocks.1"],
    "leaf_module_cls": ["Embed", "Head"],
}


def _config(**pipeline: Any) -> dict[str, Any]:
    import nxd_trainer as nxd
    from nxd_trainer.testing import Block

    return nxd.neuronx_distributed_config(
        pipeline_parallel_size=2,
        pipeline_config={"transformer_layer_cls": Block, **PIPELINE, **pipeline},
        optimizer_config={"zero_one_enabled": False, "grad_clipping": False},
    )


def _my_rows(ids: torch.Tensor) -> torch.Tensor:
    import nxd_state

    state = nxd_state.get_parallel_state()
    return ids.chunk(state.data_parallel_size)[state.data_parallel_rank]


def _grad_bytes(model: torch.nn.Module) -> int:
    return sum(4 * p.numel() for p in model.parameters() if p.requires_grad)


def _dp_all_reduce_bytes(counter: Any) -> int:
    return counter.total(op="all_reduce", group="dp").bytes


def _reference_grads(batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """∇ Σ_k mean-loss(batch k), one process."""
    model = R.get_model()
    for ids in batches:
        model(ids, ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_grads(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], **GRAD_TOL, msg=name)


def check_optimizer_wrapper_reduces_once() -> None:
    import nxd_state
    import nxd_trainer as nxd

    config = _config()
    model = nxd.initialize_parallel_model(config, R.get_model, tensor_parallel=True)
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.SGD, model.parameters(), lr=0.1
    )
    # The optimizer holds the config's own sections (one class each, nothing converted).
    parsed = nxd.NxDConfig.from_nxd(config)
    assert optimizer.config == parsed.optimizer_config
    assert optimizer.mixed_precision == parsed.mixed_precision_config
    ids = R.batches()[0]
    with nxd_state.count_collectives() as counter:
        model.run_train(_my_rows(ids), _my_rows(ids))
        assert _dp_all_reduce_bytes(counter) == 0  # the pipeline left DP to the optimizer
        optimizer.step()
    assert _dp_all_reduce_bytes(counter) == _grad_bytes(model), counter.as_dict()
    _check_grads(model, _reference_grads([ids]))  # step() left the averaged gradients


def check_accumulation_reduces_once_per_step() -> None:
    import nxd_state
    import nxd_trainer as nxd

    config = _config()
    model = nxd.initialize_parallel_model(config, R.get_model, tensor_parallel=True)
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.SGD, model.parameters(), lr=0.1
    )
    micro = R.batches()[:2]
    with nxd_state.count_collectives() as counter:
        for ids in micro:  # two micro-steps, one optimizer step
            model.run_train(_my_rows(ids), _my_rows(ids))
        optimizer.step()
    assert _dp_all_reduce_bytes(counter) == _grad_bytes(model), counter.as_dict()
    _check_grads(model, _reference_grads(micro))


def check_model_reduces_without_optimizer_wrapper() -> None:
    import nxd_state
    import nxd_trainer as nxd

    config = _config()
    model = nxd.initialize_parallel_model(config, R.get_model, tensor_parallel=True)
    torch.optim.SGD(model.parameters(), lr=0.1)  # a plain optimizer: nobody else averages
    ids = R.batches()[0]
    with nxd_state.count_collectives() as counter:
        model.run_train(_my_rows(ids), _my_rows(ids))
    assert _dp_all_reduce_bytes(counter) == _grad_bytes(model), counter.as_dict()
    _check_grads(model, _reference_grads([ids]))


def check_pipeline_reduces_when_config_says_no_wrapper() -> None:
    import nxd_state
    import nxd_trainer as nxd

    config = _config(use_optimizer_wrapper=False)
    model = nxd.initialize_parallel_model(config, R.get_model, tensor_parallel=True)
    ids = R.batches()[0]
    with nxd_state.count_collectives() as counter:
        model.run_train(_my_rows(ids), _my_rows(ids))
    assert _dp_all_reduce_bytes(counter) == _grad_bytes(model), counter.as_dict()
    _check_grads(model, _reference_grads([ids]))
    with pytest.raises(ValueError, match=r"use_optimizer_wrapper'\] is False"):
        nxd.initialize_parallel_optimizer(config, torch.optim.SGD, model.parameters(), lr=0.1)


def check_naive_stack_reduces_twice() -> None:
    """What the trainer avoids: NxDPPModel's own DP average, then the wrapper's."""
    import nxd_state
    from nxd_optim import build_optimizer
    from nxd_pipeline import NxDPPModel
    from nxd_trainer.testing import Block, Embed, Head

    model = NxDPPModel(
        R.get_model(tensor_parallel=True),
        transformer_layer_cls=Block,
        leaf_module_cls=[Embed, Head],
        num_microbatches=2,
        pipeline_cuts=["blocks.1"],
    )
    optimizer = build_optimizer(
        {"grad_clipping": False}, torch.optim.SGD, model.local_parameters(), lr=0.1
    )
    ids = R.batches()[0]
    with nxd_state.count_collectives() as counter:
        model.run_train(input_ids=_my_rows(ids), labels=_my_rows(ids))
        optimizer.step()
    grad_bytes = sum(4 * p.numel() for p in model.local_parameters())
    assert _dp_all_reduce_bytes(counter) == 2 * grad_bytes, counter.as_dict()


def pp2_dp2_checks() -> list[str]:
    import nxd_state

    checks = {
        "optimizer wrapper": check_optimizer_wrapper_reduces_once,
        "accumulation": check_accumulation_reduces_once_per_step,
        "plain optimizer": check_model_reduces_without_optimizer_wrapper,
        "use_optimizer_wrapper=False": check_pipeline_reduces_when_config_says_no_wrapper,
        "naive stack": check_naive_stack_reduces_twice,
    }

    def fresh(check: Any) -> Any:
        def run() -> None:
            nxd_state.destroy_model_parallel()
            if check is check_naive_stack_reduces_twice:
                nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
            check()

        return run

    return run_named_checks({k: fresh(v) for k, v in checks.items()}, context="pp=2 dp=2")


def test_dp_gradient_reduction_happens_once_per_step() -> None:
    results = run_distributed(pp2_dp2_checks, 4)
    assert all(len(r) == 5 for r in results)
