"""Which gradient reduction ZeRO-1's ``grad_reduction="auto"`` runs on gloo, and what it moves.

On gloo ``auto`` all-reduces at 2 ranks and reduce-scatters (an all-to-all and a local sum in
``nxd_state.collectives``) from 3; the choice is measured, see nxd_optim._zero1_comm. Checked
per step, with the traffic counter: the op and its bytes (Ψ = the padded flat buffer), the
clipping norm's scalar all-reduce exactly when the gradient was reduce-scattered, one
all-gather; the CPU gradient buffer kept between steps (same storage every step); params equal
to the other reduction's within fp32 rounding (the sums run in another order).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nxd_state
from nxd_optim import NeuronZero1Optimizer
from nxd_state.testing import run_distributed

STEPS = 3
# Params move by ~lr = 1e-2 per step; the two reductions differ by fp32 rounding of sums of
# n values (~1e-7 relative), which AdamW's normalised update can amplify where v is tiny:
# 1e-5 absolute still separates "same math" from a wrong reduction (~lr).
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 16), nn.Tanh(), nn.Linear(16, 3))


def _choice_suite() -> dict:
    state = nxd_state.initialize_model_parallel()
    reference = _model()
    runs = {}
    for mode in ("auto", "all_reduce", "reduce_scatter"):
        model = copy.deepcopy(reference)
        opt = NeuronZero1Optimizer(
            list(model.parameters()), torch.optim.AdamW, lr=1e-2, grad_reduction=mode
        )
        runs[mode] = (model, opt)
    auto = runs["auto"][1]
    gen = torch.Generator().manual_seed(state.rank)
    counters, buffer_ptrs = [], []
    for _ in range(STEPS):
        x = torch.randn(4, 9, generator=gen)
        for mode, (model, opt) in runs.items():
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if mode == "auto":
                with nxd_state.count_collectives() as counter:
                    opt.step()
                counters.append(counter.as_dict())
                buffer_ptrs.append(auto.dtype_buckets[0].reduce_buffer.data_ptr())
            else:
                opt.step()
    other = "reduce_scatter" if auto._reduction == "all_reduce" else "all_reduce"
    return {
        "resolved": auto._reduction,
        "padded_bytes": 4 * auto.dtype_buckets[0].layout.padded_numel,
        "counters": counters,
        "same_buffer": len(set(buffer_ptrs)) == 1,
        "auto": [p.detach().clone() for p in runs["auto"][0].parameters()],
        "other": [p.detach().clone() for p in runs[other][0].parameters()],
        "initial": [p.detach().clone() for p in reference.parameters()],
    }


@pytest.mark.parametrize(("world", "expected"), [(2, "all_reduce"), (4, "reduce_scatter")])
def test_auto_reduction_on_gloo_by_group_size(world: int, expected: str) -> None:
    for out in run_distributed(_choice_suite, world):
        assert out["resolved"] == expected
        psi, n = out["padded_bytes"], world
        if expected == "all_reduce":  # no norm collective: every rank holds the whole sum
            step = {
                "all_reduce@dp": {"calls": 1, "bytes": psi, "wire_bytes": 2 * (n - 1) / n * psi}
            }
        else:  # the norm of disjoint shards is summed over DP: one scalar all-reduce
            step = {
                "reduce_scatter@dp": {"calls": 1, "bytes": psi, "wire_bytes": (n - 1) / n * psi},
                "all_reduce@dp": {"calls": 1, "bytes": 4, "wire_bytes": 2 * (n - 1) / n * 4},
            }
        step["all_gather@dp"] = {"calls": 1, "bytes": psi // n, "wire_bytes": (n - 1) * psi // n}
        assert out["counters"] == [step] * STEPS
        assert out["same_buffer"]
        for got, want, initial in zip(out["auto"], out["other"], out["initial"]):
            torch.testing.assert_close(got, want, **TOL)
            assert float((got - initial).abs().max()) > 1e-3  # trained: the check can fail
