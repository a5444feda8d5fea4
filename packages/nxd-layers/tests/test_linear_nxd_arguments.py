"""NxD's newer Column/RowParallelLinear arguments against one process, on 2 and 4 gloo ranks:
``pad`` (zero padding of the sharded dimension), ``reduce_dtype`` (the dtype the TP reduction
runs in) and Row's ``reduce_output=False`` (partial sums returned unreduced).

Tolerances: fp32 with torch's defaults (rtol=1.3e-6, atol=1e-5) where the parallel and the
reference layers do the same products summed in a different order (a few ulps). The
``reduce_dtype`` checks compare a bf16 layer with its definition (bf16 partials, summed in
float32, rounded to bf16 once): the float32 sum of ``tp`` terms may be ordered differently by
gloo, a difference far below one bf16 ulp that can still flip a rounding, so rtol is one
bf16 ulp (2^-8) and atol 0. That a collective ran in float32 is proven by its byte count
(nxd_state's counter: 4 bytes per element, 2 for bf16), which cannot pass by accident.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    RowParallelLinear,
    full_tensor,
    shard_for_rank,
)
from nxd_state import count_collectives
from nxd_state.testing import run_distributed, run_named_checks

FP32 = {"rtol": 1.3e-6, "atol": 1e-5}  # see the module docstring
EXACT = {"rtol": 0.0, "atol": 0.0}  # copies of the same numbers
BF16_ULP = {"rtol": 2.0**-8, "atol": 0.0}  # see the module docstring
B, S, H = 2, 8, 16
ODD = 9  # divisible by neither 2 nor 4: pad 1 at TP=2, 3 at TP=4


def _tp() -> tuple[int, int]:
    return nxd_state.get_tensor_model_parallel_size(), nxd_state.get_tensor_model_parallel_rank()


def _raises(fn: Callable[[], object], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        fn()


def _load_padded(layer: nn.Module, ref: nn.Linear, dim: int) -> None:
    """Put ``ref``'s full weights into ``layer`` through NxD's preshard_hook (zero padding)
    and this rank's slice."""
    tp, rank = _tp()
    state = {"weight": ref.weight.detach().clone(), "bias": ref.bias.detach().clone()}
    layer.preshard_hook(state, "weight")
    layer.preshard_hook(state, "bias")
    with torch.no_grad():
        layer.weight.copy_(shard_for_rank(state["weight"], dim, rank, tp))
        if getattr(layer.bias, "tensor_model_parallel", False):
            layer.bias.copy_(shard_for_rank(state["bias"], 0, rank, tp))
        else:
            layer.bias.copy_(state["bias"])


def check_pad_init(single: dist.ProcessGroup) -> None:
    """The padded master is the unpadded layer's (same seed, one rank) followed by zeros."""
    tp, _ = _tp()
    pad = -ODD % tp
    for gather in (True, False):
        torch.manual_seed(3)
        col = ColumnParallelLinear(H, ODD, gather_output=gather, pad=True)
        torch.manual_seed(3)
        whole = ColumnParallelLinear(H, ODD, gather_output=gather, tensor_parallel_group=single)
        assert (col.pad_size, col.output_size, col.output_size_per_partition) == (
            pad,
            ODD + pad,
            (ODD + pad) // tp,
        )
        weight, bias = full_tensor(col.weight), full_tensor(col.bias)
        torch.testing.assert_close(weight[:ODD], whole.weight, **EXACT)
        torch.testing.assert_close(bias[:ODD], whole.bias, **EXACT)
        assert torch.count_nonzero(weight[ODD:]) == 0
        assert torch.count_nonzero(bias[ODD:]) == 0
        assert tuple(col.bias.shape) == ((ODD + pad,) if gather else ((ODD + pad) // tp,))
    torch.manual_seed(4)
    row = RowParallelLinear(ODD, H, pad=True)
    torch.manual_seed(4)
    whole_row = RowParallelLinear(ODD, H, tensor_parallel_group=single)
    weight = full_tensor(row.weight)
    assert (row.pad_size, row.input_size, tuple(weight.shape)) == (pad, ODD + pad, (H, ODD + pad))
    torch.testing.assert_close(weight[:, :ODD], whole_row.weight, **EXACT)
    assert torch.count_nonzero(weight[:, ODD:]) == 0
    torch.testing.assert_close(row.bias, whole_row.bias, **EXACT)


def check_pad_column_gathered() -> None:
    """Column(pad=True, gather_output=True) equals nn.Linear(H, ODD): output, input gradient,
    weight and bias gradients (the zero rows get none)."""
    ref = nn.Linear(H, ODD)
    col = ColumnParallelLinear(H, ODD, gather_output=True, pad=True)
    _load_padded(col, ref, 0)
    x, g = torch.randn(B, S, H), torch.randn(B, S, ODD)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(x_ref), col(x_par)
    assert out.shape == (B, S, ODD)
    torch.testing.assert_close(out, out_ref, **FP32)
    (out_ref * g).sum().backward()
    (out * g).sum().backward()
    torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
    grad_w = full_tensor(col.weight, col.weight.grad)
    torch.testing.assert_close(grad_w[:ODD], ref.weight.grad, **FP32)
    assert torch.count_nonzero(grad_w[ODD:]) == 0
    torch.testing.assert_close(col.bias.grad[:ODD], ref.bias.grad, **FP32)
    col.skip_bias_add = True  # returns NxD's padded bias, unadded
    no_bias, bias = col(x)
    assert no_bias.shape == (B, S, ODD)
    assert bias is col.bias
    torch.testing.assert_close(no_bias + bias[:ODD], out, **EXACT)


def check_pad_mlp() -> None:
    """Column(pad=True, gather_output=False) -> GeLU -> Row(pad=True, input_is_parallel=True)
    equals the unpadded MLP in one process (the zero features stay zero: GeLU(0) = 0)."""
    up_ref, down_ref = nn.Linear(H, ODD), nn.Linear(ODD, H)
    up = ColumnParallelLinear(H, ODD, gather_output=False, pad=True)
    down = RowParallelLinear(ODD, H, input_is_parallel=True, pad=True)
    _load_padded(up, up_ref, 0)
    _load_padded(down, down_ref, 1)
    x, g = torch.randn(B, S, H), torch.randn(B, S, H)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = down_ref(F.gelu(up_ref(x_ref))), down(F.gelu(up(x_par)))
    torch.testing.assert_close(out, out_ref, **FP32)
    (out_ref * g).sum().backward()
    (out * g).sum().backward()
    torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
    up_grad = full_tensor(up.weight, up.weight.grad)
    down_grad = full_tensor(down.weight, down.weight.grad)
    torch.testing.assert_close(up_grad[:ODD], up_ref.weight.grad, **FP32)
    torch.testing.assert_close(down_grad[:, :ODD], down_ref.weight.grad, **FP32)
    assert torch.count_nonzero(up_grad[ODD:]) == 0
    assert torch.count_nonzero(down_grad[:, ODD:]) == 0
    torch.testing.assert_close(full_tensor(up.bias, up.bias.grad)[:ODD], up_ref.bias.grad, **FP32)
    torch.testing.assert_close(down.bias.grad, down_ref.bias.grad, **FP32)


def check_pad_row_splits_input() -> None:
    """Row(pad=True) on an unsplit input of the unpadded width: zero-padded, then split."""
    ref = nn.Linear(ODD, H)
    row = RowParallelLinear(ODD, H, pad=True)
    _load_padded(row, ref, 1)
    x, g = torch.randn(B, S, ODD), torch.randn(B, S, H)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(x_ref), row(x_par)
    torch.testing.assert_close(out, out_ref, **FP32)
    (out_ref * g).sum().backward()
    (out * g).sum().backward()
    torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
    torch.testing.assert_close(
        full_tensor(row.weight, row.weight.grad)[:, :ODD], ref.weight.grad, **FP32
    )


def check_pad_errors() -> None:
    tp, _ = _tp()
    _raises(lambda: ColumnParallelLinear(H, ODD), "output_size(9) is not divisible")
    _raises(lambda: ColumnParallelLinear(H, ODD), "pass pad=True")
    _raises(lambda: RowParallelLinear(ODD, H), "input_size(9) is not divisible")
    col = ColumnParallelLinear(H, ODD, pad=True)
    _raises(
        lambda: col.preshard_hook({"w": torch.zeros(ODD + 1, H)}, "w"),
        f"w has size {ODD + 1} along dim 0, expected the unpadded {ODD}",
    )
    row = RowParallelLinear(ODD, H, pad=True)
    _raises(lambda: row(torch.randn(B, S, ODD + 1)), f"input to be {ODD}")
    parallel_in = RowParallelLinear(ODD, H, pad=True, input_is_parallel=True)
    _raises(lambda: parallel_in(torch.randn(B, S, ODD)), f"input to be {(ODD + -ODD % tp) // tp}")


def _reference_sum(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum over TP of every rank's ``partial``, added in ``dtype``, cast back."""
    tp, _ = _tp()
    group = nxd_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(partial, dtype=dtype) for _ in range(tp)]
    dist.all_gather(pieces, partial.to(dtype).contiguous(), group=group)
    return torch.stack(pieces).sum(0).to(partial.dtype)


def check_reduce_dtype_row() -> None:
    """bf16 Row: the forward all-reduce runs in reduce_dtype (float32 by default, NxD's),
    and the output is the float32 sum of the bf16 partials rounded once."""
    tp, _ = _tp()
    x = torch.randn(B, S, 32 // tp).bfloat16()
    for reduce_dtype, width in ((torch.float32, 4), (torch.bfloat16, 2)):
        row = RowParallelLinear(
            32,
            H,
            bias=False,
            input_is_parallel=True,
            dtype=torch.bfloat16,
            reduce_dtype=reduce_dtype,
        )
        with count_collectives() as counter:
            out = row(x)
        assert out.dtype == torch.bfloat16
        assert counter.total(op="all_reduce").bytes == B * S * H * width, counter.as_dict()
        if reduce_dtype == torch.float32:  # (a bf16 ring sum rounds at every hop: no exact ref)
            expected = _reference_sum(F.linear(x, row.weight), reduce_dtype)
            torch.testing.assert_close(out, expected, **BF16_ULP)


def check_reduce_dtype_column_backward() -> None:
    """bf16 Column: the backward all-reduce of the input gradient runs in reduce_dtype, the
    gradient comes back bf16 and equals the float32 sum of the per-rank gradients."""
    col = ColumnParallelLinear(H, 32, gather_output=False, dtype=torch.bfloat16)
    x = torch.randn(B, S, H).bfloat16().requires_grad_()
    out = col(x)
    g = torch.randn_like(out)
    with count_collectives() as counter:
        out.backward(g)
    assert counter.total(op="all_reduce").bytes == B * S * H * 4, counter.as_dict()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, _reference_sum(g @ col.weight, torch.float32), **BF16_ULP)


def check_reduce_dtype_sequence_parallel_and_gqa() -> None:
    """Under SP the Row reduce-scatter (forward) and its all-gather (backward), and the Column
    and GQA input-gradient reduce-scatter / all-reduce, all carry float32."""
    tp, _ = _tp()
    bf16 = torch.bfloat16
    col = ColumnParallelLinear(
        H, 32, gather_output=False, sequence_parallel_enabled=True, dtype=bf16
    )
    row = RowParallelLinear(
        32, H, input_is_parallel=True, sequence_parallel_enabled=True, dtype=bf16
    )
    x = torch.randn(S // tp, B, H).to(bf16).requires_grad_()
    with count_collectives() as forward:
        out = row(F.gelu(col(x)))
    assert forward.total(op="reduce_scatter").bytes == S * B * H * 4, forward.as_dict()
    with count_collectives() as backward:
        out.backward(torch.randn_like(out))
    # Row: all-gather of the (S/tp, B, H) gradient shard; Column: reduce-scatter of (S, B, H).
    assert backward.total(op="all_gather").bytes == S // tp * B * H * 4, backward.as_dict()
    assert backward.total(op="reduce_scatter").bytes == S * B * H * 4, backward.as_dict()
    assert x.grad.dtype == bf16
    qkv = GQAQKVColumnParallelLinear(
        H, [4 * tp, 4 * tp], gather_output=False, dtype=bf16, head_dim=4
    )
    y = torch.randn(B, S, H).to(bf16).requires_grad_()
    q, k, v = qkv(y)
    with count_collectives() as gqa:
        (q.sum() + k.sum() + v.sum()).backward()
    assert gqa.total(op="all_reduce").bytes == B * S * H * 4, gqa.as_dict()
    with count_collectives() as plain:  # fp32 layers: nothing changes (same collectives)
        RowParallelLinear(32, H, input_is_parallel=True)(torch.randn(B, S, 32 // tp))
    assert plain.total(op="all_reduce").bytes == B * S * H * 4
    _raises(lambda: RowParallelLinear(32, H, reduce_dtype="fp32"), "reduce_dtype must be")
    _raises(lambda: ColumnParallelLinear(H, 32, reduce_dtype=torch.int32), "reduce_dtype must be")


def check_reduce_output_false() -> None:
    """Row(reduce_output=False): no collective; rank r returns X_r A_r + b (NxD adds the bias on
    every rank), so the sum over ranks is nn.Linear's output plus (tp - 1) b; the weight and
    bias gradients of each rank's loss are the reference's."""
    tp, rank = _tp()
    ref = nn.Linear(32, H)
    row = RowParallelLinear(32, H, input_is_parallel=True, reduce_output=False)
    with torch.no_grad():
        row.weight.copy_(ref.weight.chunk(tp, dim=1)[rank])
        row.bias.copy_(ref.bias)
    x, g = torch.randn(B, S, 32), torch.randn(B, S, H)
    with count_collectives() as counter:
        out = row(x.chunk(tp, dim=-1)[rank].contiguous())
    assert counter.total().calls == 0
    summed = _reference_sum(out.detach(), torch.float32)
    out_ref = ref(x)
    torch.testing.assert_close(summed, out_ref + (tp - 1) * ref.bias.detach(), **FP32)
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    torch.testing.assert_close(row.weight.grad, ref.weight.grad.chunk(tp, dim=1)[rank], **FP32)
    torch.testing.assert_close(row.bias.grad, ref.bias.grad, **FP32)


def run_checks(tp: int) -> list[str]:
    """Every check on this rank, in order (see ``run_named_checks``)."""
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    checks: dict[str, Callable[[], None]] = {
        "pad_init": lambda: check_pad_init(singles[dist.get_rank()]),
        "pad_column_gathered": check_pad_column_gathered,
        "pad_mlp": check_pad_mlp,
        "pad_row_splits_input": check_pad_row_splits_input,
        "pad_errors": check_pad_errors,
        "reduce_dtype_row": check_reduce_dtype_row,
        "reduce_dtype_column_backward": check_reduce_dtype_column_backward,
        "reduce_dtype_sequence_parallel_and_gqa": check_reduce_dtype_sequence_parallel_and_gqa,
        "reduce_output_false": check_reduce_output_false,
    }
    return run_named_checks(checks, seed=300, context=f"tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_nxd_linear_arguments_match_one_process(tp: int) -> None:
    """pad, reduce_dtype and reduce_output on ``tp`` ranks (one spawn); failures name a check."""
    names = run_distributed(run_checks, tp, tp)
    assert names == [names[0]] * tp
    assert len(names[0]) == 9
