"""Bad input fails early with a message naming the offending value and what was expected."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nxd_state
from nxd_optim import NeuronZero1Optimizer, NxDOptimizer, build_optimizer
from nxd_state.testing import run_distributed


def test_empty_param_list_and_wrong_optimizer_class() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        NeuronZero1Optimizer([], torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match="param group 0 has an empty 'params' list"):
        NeuronZero1Optimizer([{"params": []}], torch.optim.AdamW, lr=1e-3)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer subclass, got 'adamw'"):
        NeuronZero1Optimizer([nn.Parameter(torch.zeros(2))], "adamw")  # type: ignore[arg-type]


def test_zero1_rejects_a_bad_max_norm() -> None:
    for bad in (-1.0, 0.0, math.nan):  # inf is allowed: measure the norm, clip nothing
        with pytest.raises(ValueError, match=rf"max_norm must be positive .*got {bad}"):
            NeuronZero1Optimizer([nn.Parameter(torch.zeros(2))], torch.optim.SGD, max_norm=bad)


def _bad_inputs() -> list[str]:
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)  # DP = 1, TP = 2
    messages = []

    def expect(error: type[Exception], pattern: str, make: object) -> None:
        with pytest.raises(error, match=pattern) as info:
            make()  # type: ignore[operator]
        messages.append(str(info.value))

    good = nn.Parameter(torch.zeros(3))
    expect(  # sharding over TP ranks is not data parallelism
        ValueError,
        r"sharding group \[0, 1\] does not match the data-parallel layout",
        lambda: NeuronZero1Optimizer([good], torch.optim.SGD, lr=0.1, sharding_groups=[[0, 1]]),
    )
    expect(
        ValueError,
        r"must partition the world's ranks 0..1",
        lambda: NeuronZero1Optimizer([good], torch.optim.SGD, lr=0.1, sharding_groups=[[0]]),
    )
    expect(
        ValueError,
        r"param 1 \(shape \(2,\)\) is on meta, but the gloo process group moves cpu or cuda",
        lambda: NeuronZero1Optimizer(
            [good, nn.Parameter(torch.zeros(2, device="meta"))], torch.optim.SGD, lr=0.1
        ),
    )
    expect(
        ValueError,
        r"grad_reduction must be one of \('auto', 'reduce_scatter', 'all_reduce'\), got 'ring'",
        lambda: NeuronZero1Optimizer([good], torch.optim.SGD, lr=0.1, grad_reduction="ring"),
    )
    expect(
        ValueError,
        r"bucket_cap_mb_all_gather must be >= 0 \(0: no cap\), got -1",
        lambda: NeuronZero1Optimizer([good], torch.optim.SGD, lr=0.1, bucket_cap_mb_all_gather=-1),
    )
    lazy = NeuronZero1Optimizer([good], torch.optim.SGD, lr=0.1, lazy_init=True)
    expect(RuntimeError, r"step: .*lazy_init=True.*call init_zero\(\) first", lazy.step)
    expect(
        AttributeError,
        r"base_optimizer does not exist before init_zero",
        lambda: lazy.base_optimizer,
    )
    lazy.init_zero()

    def change_groups() -> None:
        lazy.sharding_groups = [[0], [1]]

    expect(RuntimeError, r"sharding_groups can only change before init_zero\(\)", change_groups)
    expect(
        ValueError,
        r"param 0 \(shape \(4,\)\) does not require grad",
        lambda: NeuronZero1Optimizer(
            [nn.Parameter(torch.zeros(4), requires_grad=False)], torch.optim.SGD, lr=0.1
        ),
    )
    expect(
        ValueError,
        "NxDOptimizer got an empty parameter list",
        lambda: NxDOptimizer([], torch.optim.SGD),
    )
    expect(
        ValueError,
        r"NxDOptimizer: param 0 \(shape \(2,\)\) is on meta",
        lambda: build_optimizer(
            None, torch.optim.SGD, [nn.Parameter(torch.zeros(2, device="meta"))], lr=0.1
        ),
    )
    opt = NeuronZero1Optimizer([good], torch.optim.SGD, lr=0.1)
    state = opt.state_dict()
    state["shard"] = {**state["shard"], "sharding_size": 4}
    expect(
        ValueError,
        "sharded over 4 ranks, but this one shards over 1",
        lambda: opt.load_state_dict(state),
    )
    xla = {  # torch-xla's ZeRO-1 format, for params of other shapes: refused before gathering
        "state": {},
        "param_groups": [{"params": [0], "lr": 0.1}],
        "base_state": {0: {}},
        "shape_info": {0: torch.Size([4])},
    }
    expect(
        ValueError,
        r"torch-xla ZeRO-1 state dict has param shapes \{0: \(4,\)\}, this optimizer holds "
        r"\{0: \(3,\)\}",
        lambda: opt.load_state_dict(xla),
    )
    return messages


def test_bad_distributed_input_fails_early_with_clear_errors() -> None:
    results = run_distributed(_bad_inputs, 2)
    assert len(results[0]) == 13
