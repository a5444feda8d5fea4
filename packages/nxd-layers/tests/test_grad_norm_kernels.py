"""The kernels behind get_grad_norm / clip_grads_with_norm (issue 28): per-tensor norms by
``tensor_norms`` (the inf norm from ``aminmax`` on CPU) and the grouped ``_foreach_mul_``
clip give the values of the plain per-tensor formulas, bit for bit where the formula is the
same, and NaN propagates."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nxd_layers import clip_grads_with_norm, get_grad_norm, tensor_norms

_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


@pytest.mark.parametrize("dtype", _DTYPES)
def test_inf_norm_is_the_exact_max_abs(dtype: torch.dtype) -> None:
    """max |t| is a value of t: exact in any dtype (the largest magnitude negative here)."""
    torch.manual_seed(0)
    tensors = [torch.randn(37, 5).to(dtype), torch.randn(3).to(dtype), torch.randn(1).to(dtype)]
    tensors[0][4, 2] = -9.5
    got = tensor_norms(tensors, math.inf)
    want = torch.stack([t.double().abs().max() for t in tensors])
    assert got.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.equal(got.double(), want)  # exact: no rounding anywhere


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("dtype", _DTYPES)
def test_p_norms_equal_vector_norm_in_the_accumulation_dtype(dtype: torch.dtype, p: float) -> None:
    torch.manual_seed(1)
    tensors = [torch.randn(64, 9).to(dtype), torch.randn(11).to(dtype)]
    accumulation = torch.promote_types(dtype, torch.float32)
    want = torch.stack([torch.linalg.vector_norm(t, p, dtype=accumulation) for t in tensors])
    torch.testing.assert_close(tensor_norms(tensors, p), want, rtol=0, atol=0)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_nan_and_inf_propagate(p: float) -> None:
    grads = [torch.tensor([1.0, float("nan"), -3.0]), torch.tensor([2.0])]
    assert torch.isnan(tensor_norms(grads, p)[0])
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    assert torch.isnan(get_grad_norm(params, p, tensor_parallel_group=None))
    grads = [torch.tensor([1.0, float("-inf")])]
    assert tensor_norms(grads, p)[0] == math.inf


def test_clip_equals_the_per_tensor_product_bit_for_bit() -> None:
    """One _foreach_mul_ per (device, dtype) with the factor cast once = g.mul_(factor cast
    to g's dtype) tensor by tensor; a factor of exactly 1 (skipped on CPU) changes nothing,
    -0.0 included."""
    torch.manual_seed(2)
    params = []
    for shape, dtype in [((8, 3), torch.float32), ((5,), torch.bfloat16), ((4, 2), torch.float64)]:
        param = nn.Parameter(torch.zeros(shape, dtype=dtype))
        param.grad = torch.randn(shape).to(dtype)
        params.append(param)
    params[0].grad[0, 0] = -0.0
    expected = [p.grad.clone() for p in params]
    total = torch.tensor(7.3)
    factor = torch.clamp(1.0 / (total + 1e-6), max=1.0)
    for grad in expected:
        grad.mul_(factor.to(grad.dtype))
    clip_grads_with_norm(params, total, 1.0)
    for param, want in zip(params, expected):
        assert torch.equal(param.grad, want)
    before = [p.grad.clone() for p in params]
    clip_grads_with_norm(params, torch.tensor(0.5), 1.0)  # factor 1: nothing to do
    for param, want in zip(params, before):
        assert torch.equal(param.grad, want)
        assert torch.equal(param.grad.signbit(), want.signbit())
