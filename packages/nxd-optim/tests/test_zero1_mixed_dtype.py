"""ZeRO-1 on param groups mixing bf16 and fp32 params (bf16 linears, fp32 norm), DP=2.

Each group is split into one flat bucket per dtype. The reference trains the same mixed model
in one process on the whole batch with fp32 master weights (AdamW over fp32 copies, clipped,
copied back), which is the math ZeRO-1 runs with its defaults. Both start from
bf16-representable weights. Tolerance, as in test_mixed_precision.py: the bf16 forward and
backward over a different batch split perturb each gradient by ~2^-8 relative; Adam's update
is at most ~lr = 1e-3 per element per step and the perturbation changes its direction by a
small fraction of that, so 5 steps x lr x 10% = 5e-4 (atol) on every param, plus one bf16 ulp
(rtol 2^-8) where the fp32 masters round to bf16 params. A param updated with another
bucket's gradient or hyper-parameters (weight decay 1.0 on group 0) would be off by ~lr per
step; the params move by > 4 x atol (asserted; measured: max error 1.2e-4, moved 1.0e-2),
so the comparison can fail.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import nxd_state
from nxd_optim import NeuronZero1Optimizer
from nxd_state.testing import run_distributed

STEPS = 5
LR = 1e-3
MAX_NORM = 0.5
TOL = {"rtol": 2**-8, "atol": 5e-4}  # see the module docstring


class _Mixed(nn.Module):
    """bf16 linears around an fp32 LayerNorm, as mixed-precision recipes keep norms."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.lin2 = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x.bfloat16())
        h = torch.tanh(self.norm(h.float()))
        return self.lin2(h.bfloat16()).float()


def _model() -> _Mixed:
    torch.manual_seed(0)
    model = _Mixed()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())  # bf16-representable: both runs start equal
        for norm_param in model.norm.parameters():
            norm_param.add_(torch.randn_like(norm_param) * 0.1)  # a non-trivial fp32 norm
    model.lin1.bfloat16()
    model.lin2.bfloat16()
    return model


def _groups(model: _Mixed) -> list[dict]:
    """Both groups interleave dtypes: [bf16, fp32, bf16]."""
    weights = [model.lin1.weight, model.norm.weight, model.lin2.weight]
    biases = [model.lin1.bias, model.norm.bias, model.lin2.bias]
    return [{"params": weights, "weight_decay": 1.0}, {"params": biases, "weight_decay": 0.0}]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)


class _MasterWeightAdamW:
    """One process: AdamW over fp32 copies of the (mixed) params, clipped, copied back."""

    def __init__(self, model: _Mixed) -> None:
        self.params = [p for group in _groups(model) for p in group["params"]]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        groups = _groups(model)
        split = len(groups[0]["params"])
        self.optimizer = torch.optim.AdamW(
            [
                {"params": self.masters[:split], "weight_decay": 1.0},
                {"params": self.masters[split:], "weight_decay": 0.0},
            ],
            lr=LR,
        )

    def step(self) -> float:
        for param, master in zip(self.params, self.masters):
            master.grad = param.grad.float()
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM))
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.copy_(master)
                param.grad = None
        return norm


def _mixed_suite() -> dict:
    state = nxd_state.initialize_model_parallel()
    dp, rank = state.data_parallel_size, state.data_parallel_rank
    ref = _model()
    initial = copy.deepcopy(ref)
    reference = _MasterWeightAdamW(ref)
    runs = {}
    for reduction in ("auto", "reduce_scatter"):  # all-reduce + slice on gloo, and the other
        model = copy.deepcopy(ref)
        opt = NeuronZero1Optimizer(
            _groups(model), torch.optim.AdamW, lr=LR, max_norm=MAX_NORM, grad_reduction=reduction
        )
        runs[reduction] = (model, opt)
    bf16, fp32 = torch.bfloat16, torch.float32
    layout = [(b.group_index, b.dtype, b.positions) for b in runs["auto"][1]._buckets]
    assert layout == [(0, bf16, (0, 2)), (0, fp32, (1,)), (1, bf16, (0, 2)), (1, fp32, (1,))]
    assert all(b.master.dtype == fp32 for b in runs["auto"][1]._buckets)
    assert runs["auto"][1].optimizer_dtype == fp32
    errors = []
    for step in range(STEPS):
        x, y = _batch(step)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_norm = reference.step()
        assert ref_norm > MAX_NORM, "the test must exercise clipping"
        for model, opt in runs.values():
            opt.zero_grad()
            local = slice(rank * 8 // dp, (rank + 1) * 8 // dp)
            nn.functional.mse_loss(model(x[local]), y[local]).backward()
            opt.step()
            # the norm of bf16 gradients summed in another order: bf16 precision (2^-7)
            torch.testing.assert_close(opt.grad_norm, torch.tensor(ref_norm), rtol=2**-7, atol=0)
            for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
                assert p.dtype == p_ref.dtype, name
                torch.testing.assert_close(p, p_ref, **TOL, msg=lambda m, n=name: f"{n}: {m}")
                errors.append(float((p.float() - p_ref.float()).abs().max()))
    moved = max(
        float((p.float() - q.float()).abs().max())
        for p, q in zip(ref.parameters(), initial.parameters())
    )
    assert moved > 4 * TOL["atol"], moved
    opt = runs["auto"][1]
    full_bytes = sum(
        v.numel() * v.element_size()
        for s in reference.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    # per rank: 1/DP of the fp32 state, plus < DP padding elements and one step per bucket
    assert opt.state_nbytes(include_master=False) <= 1.05 * full_bytes / dp
    _resumes_exactly(runs["auto"][0], opt)
    return {"max_error": max(errors), "moved": moved}


def _resumes_exactly(model: _Mixed, opt: NeuronZero1Optimizer) -> None:
    """With the master shards in the state dict, a fresh optimizer over the four buckets
    continues bit for bit; without them its masters are rebuilt from the bf16 params."""
    dp_rank = nxd_state.get_parallel_state().data_parallel_rank
    opt.use_master_weights_in_ckpt = True
    snapshot = copy.deepcopy(opt.state_dict())
    assert len(snapshot["master_weights"]) == 4
    weights = copy.deepcopy(model.state_dict())

    def one_step(m: _Mixed, o: NeuronZero1Optimizer) -> None:
        x, y = _batch(STEPS)
        o.zero_grad()
        local = slice(dp_rank * 4, dp_rank * 4 + 4)
        nn.functional.mse_loss(m(x[local]), y[local]).backward()
        o.step()

    one_step(model, opt)
    resumed = _model()
    resumed.load_state_dict(weights)
    opt2 = NeuronZero1Optimizer(_groups(resumed), torch.optim.AdamW, lr=5.0, max_norm=MAX_NORM)
    opt2.load_state_dict(snapshot)
    one_step(resumed, opt2)
    for p, q in zip(resumed.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # same ops, same order: exact
    # without master weights the fp32 buckets keep their dtype, the bf16 ones step in bf16
    plain = NeuronZero1Optimizer(_groups(_model()), torch.optim.AdamW, use_master_weights=False)
    assert [b.master.dtype for b in plain._buckets] == [torch.bfloat16, torch.float32] * 2
    assert plain.optimizer_dtype is None  # no single optimizer dtype


def test_zero1_mixed_bf16_fp32_groups_match_single_process() -> None:
    results = run_distributed(_mixed_suite, 2)
    assert results[0]["max_error"] < TOL["atol"]
