"""Output- and input-channel-parallel Conv2d against torch.nn.Conv2d on 2 gloo ranks.

Each rank builds the reference nn.Conv2d from the same seed, loads its kernel into the parallel
layer by slicing the channel dim, runs both on the same input and upstream gradient and
compares outputs, the input gradient and every gathered weight/bias gradient; also the
back-to-back pair (output-channel without gather -> ReLU -> input-channel with
input_is_parallel), the layers' own initialisation (nn.Conv2d's from the same seed),
``partition_pad`` and NxD's errors.

Tolerance: fp32 with torch's defaults (rtol=1.3e-6, atol=1e-5): the parallel convolutions do
the reference's products; only the input-channel split sums its partial outputs across ranks
in a different order (a few ulps on O(1) values).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nxd_state
from nxd_layers import (
    BaseParallelConv,
    InputChannelParallelConv2d,
    OutputChannelParallelConv2d,
    full_tensor,
)
from nxd_state.testing import run_distributed, run_named_checks

FP32 = {"rtol": 1.3e-6, "atol": 1e-5}  # see the module docstring
EXACT = {"rtol": 0.0, "atol": 0.0}
N, C_IN, C_OUT, HW = 2, 4, 6, 9
CONV = {"kernel_size": 3, "stride": 2, "padding": 1, "dilation": 2}


def _tp() -> tuple[int, int]:
    return nxd_state.get_tensor_model_parallel_size(), nxd_state.get_tensor_model_parallel_rank()


def _load(par: BaseParallelConv, ref: nn.Conv2d) -> None:
    tp, rank = _tp()
    with torch.no_grad():
        par.weight.copy_(ref.weight.chunk(tp, dim=par.partition_dim)[rank])
        if par.bias is not None:
            sharded = par.bias.tensor_model_parallel
            par.bias.copy_(ref.bias.chunk(tp)[rank] if sharded else ref.bias)


def _compare_grads(pairs: list[tuple[BaseParallelConv, nn.Conv2d]]) -> None:
    for par, ref in pairs:
        for name in ("weight", "bias"):
            p = getattr(par, name)
            torch.testing.assert_close(full_tensor(p, p.grad), getattr(ref, name).grad, **FP32)


def check_output_channel(gather_output: bool) -> None:
    tp, rank = _tp()
    ref = nn.Conv2d(C_IN, C_OUT, **CONV)
    par = OutputChannelParallelConv2d(C_IN, C_OUT, **CONV, gather_output=gather_output)
    _load(par, ref)
    assert par.weight.shape == (C_OUT // tp, C_IN, 3, 3)
    assert par.bias.shape == (C_OUT // tp,)
    x = torch.randn(N, C_IN, HW, HW)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    g = torch.randn_like(out_ref)
    out_par = par(x_par)
    if not gather_output:  # this rank's output channels
        out_ref_local, g_par = out_ref.chunk(tp, dim=1)[rank], g.chunk(tp, dim=1)[rank]
    else:
        out_ref_local, g_par = out_ref, g
    torch.testing.assert_close(out_par, out_ref_local, **FP32)
    (out_ref * g).sum().backward()
    (out_par * g_par).sum().backward()
    torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)  # summed over TP
    _compare_grads([(par, ref)])


def check_input_channel(input_is_parallel: bool) -> None:
    tp, rank = _tp()
    ref = nn.Conv2d(C_IN, C_OUT, **CONV)
    par = InputChannelParallelConv2d(C_IN, C_OUT, **CONV, input_is_parallel=input_is_parallel)
    _load(par, ref)
    assert par.weight.shape == (C_OUT, C_IN // tp, 3, 3)
    assert par.bias.shape == (C_OUT,)
    assert not par.bias.tensor_model_parallel  # replicated, added after the all-reduce
    x = torch.randn(N, C_IN, HW, HW)
    x_ref = x.clone().requires_grad_()
    x_par = (x.chunk(tp, dim=1)[rank] if input_is_parallel else x).clone().requires_grad_()
    out_ref, out_par = ref(x_ref), par(x_par)
    torch.testing.assert_close(out_par, out_ref, **FP32)
    g = torch.randn_like(out_ref)
    (out_ref * g).sum().backward()
    (out_par * g).sum().backward()
    gx = x_ref.grad.chunk(tp, dim=1)[rank] if input_is_parallel else x_ref.grad
    torch.testing.assert_close(x_par.grad, gx, **FP32)
    _compare_grads([(par, ref)])


def check_back_to_back() -> None:
    """NxD's pairing: one all-reduce forward (after conv2), one backward (into conv1's input)."""
    refs = (nn.Conv2d(C_IN, C_OUT, 3, padding=1), nn.Conv2d(C_OUT, C_IN, 3, padding=1))
    pars = (
        OutputChannelParallelConv2d(C_IN, C_OUT, 3, padding=1, gather_output=False),
        InputChannelParallelConv2d(C_OUT, C_IN, 3, padding=1, input_is_parallel=True),
    )
    for par, ref in zip(pars, refs):
        _load(par, ref)
    x = torch.randn(N, C_IN, HW, HW)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = refs[1](torch.relu(refs[0](x_ref)))
    out_par = pars[1](torch.relu(pars[0](x_par)))
    torch.testing.assert_close(out_par, out_ref, **FP32)
    g = torch.randn_like(out_ref)
    (out_ref * g).sum().backward()
    (out_par * g).sum().backward()
    torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
    _compare_grads(list(zip(pars, refs)))


def check_init_and_masters() -> None:
    """Both layers draw nn.Conv2d's kernel and bias from the seed and keep their slices."""
    for cls in (OutputChannelParallelConv2d, InputChannelParallelConv2d):
        torch.manual_seed(3)
        par = cls(C_IN, C_OUT, 3, keep_master_weight=True)
        torch.manual_seed(3)
        ref = nn.Conv2d(C_IN, C_OUT, 3)
        for name in ("weight", "bias"):
            p, expected = getattr(par, name), getattr(ref, name).detach()
            torch.testing.assert_close(full_tensor(p), expected, **EXACT, msg=cls.__name__)
            torch.testing.assert_close(getattr(par, f"master_{name}"), expected, **EXACT)
    meta = OutputChannelParallelConv2d(C_IN, C_OUT, 3, device="meta", keep_master_weight=True)
    assert meta.weight.is_meta
    assert meta.master_weight is None


def check_partition_pad() -> None:
    """Odd channel counts: zero channels appended (zero kernel and bias), dropped on gather;
    a back-to-back padded pair still equals the unpadded convolutions."""
    tp, rank = _tp()
    odd = 2 * tp + 1
    out_conv = OutputChannelParallelConv2d(C_IN, odd, 3, padding=1, partition_pad=True)
    assert out_conv.out_channels == 3 * tp
    assert out_conv.partition_pad_size == tp - 1
    ref = nn.Conv2d(C_IN, odd, 3, padding=1)
    state = {"w": ref.weight.detach().clone()}
    out_conv.preshard_hook(state, "w")  # NxD's hook: the unpadded kernel padded, then sliced
    with torch.no_grad():
        out_conv.weight.copy_(state["w"].chunk(tp)[rank])
        out_conv.bias.copy_(torch.nn.functional.pad(ref.bias, (0, tp - 1)).chunk(tp)[rank])
    x = torch.randn(N, C_IN, HW, HW)
    torch.testing.assert_close(out_conv(x), ref(x), **FP32)
    # A pair through the padded channels: conv2 pads its input channels the same way.
    conv1 = OutputChannelParallelConv2d(
        C_IN, odd, 3, padding=1, gather_output=False, partition_pad=True
    )
    conv2 = InputChannelParallelConv2d(
        odd, C_IN, 3, padding=1, input_is_parallel=True, partition_pad=True
    )
    refs = (nn.Conv2d(C_IN, odd, 3, padding=1), nn.Conv2d(odd, C_IN, 3, padding=1))
    full1, full2 = full_tensor(conv1.weight), full_tensor(conv2.weight)
    assert torch.count_nonzero(full1[odd:]) == 0
    assert torch.count_nonzero(full2[:, odd:]) == 0
    with torch.no_grad():
        refs[0].weight.copy_(full1[:odd])
        refs[0].bias.copy_(full_tensor(conv1.bias)[:odd])
        refs[1].weight.copy_(full2[:, :odd])
        refs[1].bias.copy_(conv2.bias)
    torch.testing.assert_close(conv2(torch.relu(conv1(x))), refs[1](torch.relu(refs[0](x))), **FP32)
    unsplit = InputChannelParallelConv2d(odd, C_IN, 3, padding=1, partition_pad=True)
    with torch.no_grad():
        unsplit.weight.copy_(conv2.weight)
        unsplit.bias.copy_(conv2.bias)
    y = torch.randn(N, odd, HW, HW)
    torch.testing.assert_close(unsplit(y), refs[1](y), **FP32)  # input padded, then split


def check_errors() -> None:
    tp, _ = _tp()
    with pytest.raises(NotImplementedError, match="groups must be 1, got 2"):
        OutputChannelParallelConv2d(C_IN, C_OUT, 3, groups=2)
    with pytest.raises(NotImplementedError, match="padding_mode must be 'zeros'"):
        InputChannelParallelConv2d(C_IN, C_OUT, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match=re.escape(f"out_channels({2 * tp + 1})")):
        OutputChannelParallelConv2d(C_IN, 2 * tp + 1, 3)
    conv = InputChannelParallelConv2d(C_IN, C_OUT, 3)
    with pytest.raises(ValueError, match=re.escape(f"C = {C_IN}")):
        conv(torch.randn(N, C_IN + 1, HW, HW))
    with pytest.raises(TypeError, match="kernel_size"):
        OutputChannelParallelConv2d(C_IN, C_OUT, (3, 3, 3))


CHECKS: dict[str, Callable[[], None]] = {
    "output_channel_gather": lambda: check_output_channel(gather_output=True),
    "output_channel_no_gather": lambda: check_output_channel(gather_output=False),
    "input_channel_split_here": lambda: check_input_channel(input_is_parallel=False),
    "input_channel_parallel_input": lambda: check_input_channel(input_is_parallel=True),
    "back_to_back": check_back_to_back,
    "init_and_masters": check_init_and_masters,
    "partition_pad": check_partition_pad,
    "errors": check_errors,
}


def run_checks(tp: int) -> list[str]:
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return run_named_checks(CHECKS, seed=400, context=f"tp={tp}")


def test_parallel_conv2d_matches_torch() -> None:
    """Every check of CHECKS on 2 ranks (one spawn); a failure names its check."""
    assert run_distributed(run_checks, 2, 2) == [list(CHECKS)] * 2
