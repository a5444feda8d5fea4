"""AdamWFP32OptimParams (NxD's AdamW_FP32OptimParams): the Hugging Face AdamW, fp32 state.

* fp32 params: equal to ``torch.optim.AdamW`` where the two formulas agree, and to an fp64
  transcription of the Hugging Face formula where they do not (ε before the bias correction,
  weight decay after the update);
* bf16 params: the moments are fp32 and match an fp64 computation to fp32 precision, which
  torch's AdamW on the same bf16 params (bf16 moments) cannot; the param is the fp32 update
  rounded once to bf16; a state dict round trip keeps the moments fp32.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from nxd_optim import AdamW_FP32OptimParams, AdamWFP32OptimParams


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@torch.no_grad()
def _moved(model: nn.Module) -> float:
    return max(
        float((p - q).abs().max()) for p, q in zip(model.parameters(), _model().parameters())
    )


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def test_nxd_spelling_and_defaults() -> None:
    assert AdamW_FP32OptimParams is AdamWFP32OptimParams
    optimizer = AdamW_FP32OptimParams(_model().parameters())
    assert optimizer.defaults == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-6,
        "weight_decay": 0.0,
        "correct_bias": True,
        "capturable": False,
    }
    with pytest.warns(FutureWarning, match="no_deprecation_warning=True"):
        AdamW_FP32OptimParams(_model().parameters(), no_deprecation_warning=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdamW_FP32OptimParams(_model().parameters())  # NxD's default: no warning
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\), got 1.0"):
        AdamW_FP32OptimParams(_model().parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"lr must be >= 0, got -0\.1"):
        AdamW_FP32OptimParams(_model().parameters(), lr=-0.1)


def test_fp32_params_equal_torch_adamw() -> None:
    """Where the formulas coincide they agree to fp32 rounding: ε enters as ε·√(1-β2^t) in
    torch's form, a relative change of ε/√v ≈ 1e-8/1e-2 of an update of ~lr, and decay-after
    differs from decay-before by lr·λ·|update| ≤ lr²·λ = 1e-7 per step: both far below the
    fp32 tolerance of assert_close (rtol 1.3e-6, atol 1e-5)."""
    ref = _model()
    model = copy.deepcopy(ref)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    _train(ref, torch.optim.AdamW(ref.parameters(), **hyper), 10)
    _train(model, AdamWFP32OptimParams(model.parameters(), **hyper), 10)
    assert _moved(ref) > 5e-3  # ten steps of ~lr: the comparison below is not trivially satisfied
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def _hf_adamw_fp64(
    p: torch.Tensor, grads: list[torch.Tensor], lr: float, betas, eps, wd, correct_bias
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Hugging Face AdamW, transcribed in fp64: (param, exp_avg, exp_avg_sq)."""
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), None
    v = torch.zeros_like(m)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        alpha = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t) if correct_bias else lr
        p = p - alpha * m / (v.sqrt() + eps)
        p = p - lr * wd * p
    return p, m, v


@pytest.mark.parametrize("correct_bias", [True, False])
def test_fp32_params_follow_the_hugging_face_formula(correct_bias: bool) -> None:
    """Large ε and λ, where torch's AdamW differs: fp32 arithmetic vs an fp64 transcription,
    a few ulps of the ~1 parameters (rtol 1e-6) after 6 steps."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=gen)
    grads = [torch.randn(50, generator=gen) * 1e-2 for _ in range(6)]
    hyper = {"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-2, "weight_decay": 0.5}
    param = nn.Parameter(start.clone())
    optimizer = AdamWFP32OptimParams([param], correct_bias=correct_bias, **hyper)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    expected, m, _ = _hf_adamw_fp64(
        start, grads, 0.05, (0.8, 0.9), 1e-2, 0.5, correct_bias=correct_bias
    )
    torch.testing.assert_close(param.detach().double(), expected, rtol=1e-6, atol=1e-7)
    # m is a sum of ±1e-2 gradients and can cancel to ~0: fp32 ulps of the gradients (1e-9)
    torch.testing.assert_close(optimizer.state[param]["exp_avg"].double(), m, rtol=1e-6, atol=1e-9)
    assert optimizer.state[param]["step"] == 6
    torch_param = nn.Parameter(start.clone())  # torch's form lands elsewhere
    torch_optimizer = torch.optim.AdamW([torch_param], **hyper)
    for grad in grads:
        torch_param.grad = grad.clone()
        torch_optimizer.step()
    assert not torch.allclose(torch_param.detach().double(), expected, rtol=1e-6, atol=1e-7)


def test_bf16_params_keep_fp32_moments() -> None:
    """Synthetic bf16 gradients of mixed magnitudes, 8 steps. The moments depend only on the
    gradients, so against an fp64 computation from the same bf16 gradients they agree to fp32
    rounding (rtol 1e-6); bf16 moments (torch's AdamW on bf16 params) are off by ~2^-9
    relative and fail the same check. The param is bf16: the fp32 update rounded once, so it
    matches the fp64 trajectory computed from the same rounded params to one bf16 ulp."""
    gen = torch.Generator().manual_seed(1)
    start = (torch.randn(64, generator=gen)).bfloat16()
    grads = [
        (
            torch.randn(64, generator=gen) * 10 ** torch.randint(-3, 1, (64,), generator=gen)
        ).bfloat16()
        for _ in range(8)
    ]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
    param = nn.Parameter(start.clone())
    optimizer = AdamWFP32OptimParams([param], **hyper)
    torch_param = nn.Parameter(start.clone())
    torch_optimizer = torch.optim.AdamW([torch_param], **hyper)
    m = v = torch.zeros(64, dtype=torch.float64)
    for t, grad in enumerate(grads, start=1):
        before = param.detach().double()
        param.grad = grad.clone()
        optimizer.step()
        torch_param.grad = grad.clone()
        torch_optimizer.step()
        g = grad.double()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        alpha = hyper["lr"] * math.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        after = before - alpha * m / (v.sqrt() + hyper["eps"])
        after = after - hyper["lr"] * hyper["weight_decay"] * after
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param.detach().double(), after, rtol=2**-8, atol=0)
    state = optimizer.state[param]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # m sums ±g and can cancel: bound its error by fp32 ulps of the summands' magnitudes
    magnitude = torch.stack([g.double().abs() for g in grads]).sum(dim=0)
    assert ((state["exp_avg"].double() - m).abs() <= 1e-6 * magnitude).all()
    torch.testing.assert_close(state["exp_avg_sq"].double(), v, rtol=1e-6, atol=1e-15)
    bf16_moment = torch_optimizer.state[torch_param]["exp_avg_sq"]
    assert bf16_moment.dtype == torch.bfloat16
    assert not torch.allclose(bf16_moment.double(), v, rtol=1e-6, atol=1e-15)

    # A state dict round trip keeps the fp32 moments (torch's loader would cast them to bf16).
    fresh = AdamWFP32OptimParams([nn.Parameter(start.clone())], **hyper)
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    loaded = next(iter(fresh.state.values()))
    assert loaded["exp_avg_sq"].dtype == torch.float32
    torch.testing.assert_close(loaded["exp_avg_sq"], state["exp_avg_sq"], rtol=0, atol=0)
    assert loaded["step"] == 8
