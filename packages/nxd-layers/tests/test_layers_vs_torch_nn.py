"""Column/RowParallelLinear against torch.nn.Linear holding the same full weights, on 2 and 4
ranks (ParallelEmbedding: test_embedding.py).

Each rank builds the reference ``nn.Linear`` / ``nn.Embedding`` (same seed on every rank),
copies its weights into the parallel layer by slicing, runs both on the same input and
upstream gradient, and compares outputs, input gradients and every gathered weight/bias
gradient. All checks of one world size run in one ``run_distributed`` call (one spawn); the
first failing check is raised with its name.

Tolerance: fp32 with torch's defaults (rtol=1.3e-6, atol=1e-5). The parallel and the reference
computations do the same products; only the order of the (at most 64-term) sums differs, since
partial sums are added across ranks, which is a few ulps.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nxd_state
from nxd_layers import (
    BaseParallelLinear,
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_gradients,
    clip_grad_norm,
    full_tensor,
    mappings,
)
from nxd_state.testing import run_distributed, run_named_checks

FP32 = {"rtol": 1.3e-6, "atol": 1e-5}  # see the module docstring
EXACT = {"rtol": 0.0, "atol": 0.0}  # copies and slices of the same numbers
B, S, H, F = 2, 8, 16, 32  # batch, sequence, hidden, MLP width


def _tp() -> tuple[int, int]:
    return nxd_state.get_tensor_model_parallel_size(), nxd_state.get_tensor_model_parallel_rank()


def _copy_linear(parallel: nn.Module, ref: nn.Linear) -> None:
    """Load the full weights of ``ref`` into ``parallel`` by slicing along its partition dim."""
    tp, rank = parallel.tensor_parallel_size, dist.get_rank(parallel.tensor_parallel_group)
    with torch.no_grad():
        for name in ("weight", "bias"):
            dst, src = getattr(parallel, name), getattr(ref, name)
            if dst is None:
                continue
            if getattr(dst, "tensor_model_parallel", False):
                src = src.chunk(tp, dim=dst.partition_dim)[rank]
            dst.copy_(src)


def _compare_grads(parallel: nn.Module, ref: nn.Module) -> None:
    for (name, p_par), (_, p_ref) in zip(parallel.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(full_tensor(p_par, p_par.grad), p_ref.grad, **FP32, msg=name)


def _run_pair(
    ref: nn.Module, parallel: nn.Module, x: torch.Tensor, upstream: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward both; backward (out * upstream).sum() where ``upstream`` matches each output."""
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_par = parallel(x_par)
    (out_ref * upstream[0]).sum().backward()
    (out_par * upstream[1]).sum().backward()
    return out_ref, out_par, x_ref.grad, x_par.grad


def check_column(gather_output: bool, bias: bool) -> None:
    tp, rank = (
        nxd_state.get_tensor_model_parallel_size(),
        nxd_state.get_tensor_model_parallel_rank(),
    )
    ref = nn.Linear(H, F, bias=bias)
    par = ColumnParallelLinear(H, F, bias=bias, gather_output=gather_output)
    _copy_linear(par, ref)
    x, g = torch.randn(B, S, H), torch.randn(B, S, F)
    g_par = g if gather_output else g.chunk(tp, dim=-1)[rank]
    out_ref, out_par, gx_ref, gx_par = _run_pair(ref, par, x, (g, g_par))
    expected = out_ref if gather_output else out_ref.chunk(tp, dim=-1)[rank]
    torch.testing.assert_close(out_par, expected, **FP32)
    torch.testing.assert_close(gx_par, gx_ref, **FP32)
    _compare_grads(par, ref)


def check_row(input_is_parallel: bool) -> None:
    tp, rank = (
        nxd_state.get_tensor_model_parallel_size(),
        nxd_state.get_tensor_model_parallel_rank(),
    )
    ref = nn.Linear(F, H)
    par = RowParallelLinear(F, H, input_is_parallel=input_is_parallel)
    _copy_linear(par, ref)
    x, g = torch.randn(B, S, F), torch.randn(B, S, H)
    x_ref = x.clone().requires_grad_()
    x_par = (x.chunk(tp, dim=-1)[rank] if input_is_parallel else x).clone().requires_grad_()
    out_ref, out_par = ref(x_ref), par(x_par)
    (out_ref * g).sum().backward()
    (out_par * g).sum().backward()
    torch.testing.assert_close(out_par, out_ref, **FP32)
    gx_ref = x_ref.grad.chunk(tp, dim=-1)[rank] if input_is_parallel else x_ref.grad
    torch.testing.assert_close(x_par.grad, gx_ref, **FP32)
    _compare_grads(par, ref)


class _MLP(nn.Module):
    def __init__(self, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _mlp_pair(sequence_parallel: bool) -> tuple[_MLP, _MLP]:
    ref = _MLP(nn.Linear(H, F), nn.Linear(F, H))
    par = _MLP(
        ColumnParallelLinear(
            H, F, gather_output=False, sequence_parallel_enabled=sequence_parallel
        ),
        RowParallelLinear(
            F, H, input_is_parallel=True, sequence_parallel_enabled=sequence_parallel
        ),
    )
    _copy_linear(par.up, ref.up)
    _copy_linear(par.down, ref.down)
    return ref, par


def check_mlp() -> None:
    """Column (no gather) -> GeLU -> Row (input_is_parallel): the Megatron MLP."""
    ref, par = _mlp_pair(sequence_parallel=False)
    x, g = torch.randn(B, S, H), torch.randn(B, S, H)
    out_ref, out_par, gx_ref, gx_par = _run_pair(ref, par, x, (g, g))
    torch.testing.assert_close(out_par, out_ref, **FP32)
    torch.testing.assert_close(gx_par, gx_ref, **FP32)
    _compare_grads(par, ref)


def check_mlp_sequence_parallel() -> None:
    """Sequence-first [S, B, H] input split along S; all-gather in, reduce-scatter out."""
    tp, rank = (
        nxd_state.get_tensor_model_parallel_size(),
        nxd_state.get_tensor_model_parallel_rank(),
    )
    ref, par = _mlp_pair(sequence_parallel=True)
    assert par.down.bias.sequence_parallel_enabled
    x, g = torch.randn(S, B, H), torch.randn(S, B, H)
    x_ref = x.clone().requires_grad_()
    x_par = x.chunk(tp, dim=0)[rank].clone().requires_grad_()
    out_ref, out_par = ref(x_ref), par(x_par)
    (out_ref * g).sum().backward()
    (out_par * g.chunk(tp, dim=0)[rank]).sum().backward()
    torch.testing.assert_close(out_par, out_ref.chunk(tp, dim=0)[rank], **FP32)
    torch.testing.assert_close(x_par.grad, x_ref.grad.chunk(tp, dim=0)[rank], **FP32)
    # The replicated row bias saw only this rank's sequence shard: sum it over TP first.
    local_bias_grad = par.down.bias.grad.clone()
    allreduce_sequence_parallel_gradients(par.parameters())
    _compare_grads(par, ref)
    if tp > 1:  # the sum really changed a partial gradient (so the check above can fail)
        assert not torch.allclose(local_bias_grad, par.down.bias.grad)


def check_init_matches_tp1() -> None:
    """Slices of a master weight drawn from the seed: any TP degree builds the TP=1 weights."""
    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank builds all
    built = {}
    for label, group in (("tp", None), ("tp1", singles[rank])):
        torch.manual_seed(1234)
        built[label] = (
            ColumnParallelLinear(H, F, tensor_parallel_group=group),
            ColumnParallelLinear(H, F, stride=2, tensor_parallel_group=group),
            RowParallelLinear(F, H, tensor_parallel_group=group),
        )
    for sharded, whole in zip(built["tp"], built["tp1"]):
        for p_sharded, p_whole in zip(sharded.parameters(), whole.parameters()):
            torch.testing.assert_close(full_tensor(p_sharded), p_whole, **EXACT)
    # On a group of one rank the layers are plain linears (no collective, no autograd node).
    x = torch.randn(B, S, H)
    col1, _, row1 = built["tp1"]
    torch.testing.assert_close(col1(x), x @ col1.weight.T + col1.bias, **FP32)
    y = torch.randn(B, S, F)
    torch.testing.assert_close(row1(y), y @ row1.weight.T + row1.bias, **FP32)
    torch.manual_seed(1234)
    master = torch.empty(F, H)
    nn.init.kaiming_uniform_(master, a=5**0.5)  # nn.Linear's default, drawn first
    torch.testing.assert_close(built["tp1"][0].weight, master, **EXACT)


def check_attributes_meta_dtype_master() -> None:
    tp = nxd_state.get_tensor_model_parallel_size()
    col = ColumnParallelLinear(
        H, F, gather_output=False, device="meta", dtype=torch.bfloat16, keep_master_weight=True
    )
    assert col.weight.device.type == "meta"
    assert col.weight.dtype == torch.bfloat16
    assert col.weight.shape == (F // tp, H)
    assert col.bias.shape == (F // tp,)
    assert col.master_weight is None  # nothing is drawn on meta
    row = RowParallelLinear(F, H, keep_master_weight=True)
    assert row.weight.shape == (H, F // tp)
    assert row.master_weight.shape == (H, F)
    assert (col.weight.tensor_model_parallel, col.weight.partition_dim) == (True, 0)
    assert (col.bias.tensor_model_parallel, col.bias.partition_dim) == (True, 0)
    assert (row.weight.tensor_model_parallel, row.weight.partition_dim) == (True, 1)
    assert row.bias.tensor_model_parallel is False
    assert col.output_size_per_partition == F // tp
    assert row.input_size_per_partition == F // tp
    moved = nxd_state.move_model_to_device(copy.deepcopy(row), "cpu")
    assert moved.weight.partition_dim == 1
    assert moved.weight.tensor_model_parallel


def check_skip_bias_add() -> None:
    ref = nn.Linear(H, F)
    par = ColumnParallelLinear(H, F, skip_bias_add=True)
    _copy_linear(par, ref)
    x = torch.randn(B, S, H)
    out, bias = par(x)
    torch.testing.assert_close(out, x @ ref.weight.T, **FP32)
    assert bias is par.bias


def check_column_gather_bias_is_nxd() -> None:
    """NxD: with gather_output the bias is the full (output_size,) vector on every rank, not
    TP-sharded, added after the gather; its gradient is the full one on every rank and the
    gradient norm counts it once."""
    tp, _ = _tp()
    ref = nn.Linear(H, F)
    par = ColumnParallelLinear(H, F, gather_output=True)
    assert {k: tuple(v.shape) for k, v in par.state_dict().items()} == {
        "weight": (F // tp, H),
        "bias": (F,),
    }
    assert (par.bias.tensor_model_parallel, par.bias.partition_dim) == (False, -1)
    _copy_linear(par, ref)
    torch.testing.assert_close(par.bias, ref.bias, **EXACT)  # the whole vector, copied as is
    x, g = torch.randn(B, S, H), torch.randn(B, S, F)
    _run_pair(ref, par, x, (g, g))
    torch.testing.assert_close(par.bias.grad, ref.bias.grad, **FP32)  # full on every rank
    norm = clip_grad_norm(par.parameters(), 1e9)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9), **FP32)
    out, bias = ColumnParallelLinear(H, F, skip_bias_add=True)(x)
    assert out.shape == (B, S, F)
    assert bias.shape == (F,)
    # The TP=1 layer holds the same bias (drawn whole from the seed) as any TP degree.
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective
    torch.manual_seed(9)
    sharded = ColumnParallelLinear(H, F)
    torch.manual_seed(9)
    whole = ColumnParallelLinear(H, F, tensor_parallel_group=singles[dist.get_rank()])
    torch.testing.assert_close(sharded.bias, whole.bias, **EXACT)


def check_column_stride_gather() -> None:
    """stride=2 with gather_output: the gathered features come back in W's order, so the layer
    equals nn.Linear(W) (the fused gate/up case)."""
    ref = nn.Linear(H, F)
    torch.manual_seed(21)
    par = ColumnParallelLinear(H, F, stride=2, keep_master_weight=True)
    with torch.no_grad():
        ref.weight.copy_(par.master_weight)
        ref.bias.copy_(par.bias)
    x, g = torch.randn(B, S, H), torch.randn(B, S, F)
    out_ref, out_par, gx_ref, gx_par = _run_pair(ref, par, x, (g, g))
    torch.testing.assert_close(out_par, out_ref, **FP32)
    torch.testing.assert_close(gx_par, gx_ref, **FP32)
    _compare_grads(par, ref)


def check_base_class_and_group_alias() -> None:
    """NxD's BaseParallelLinear is the base of the linear layers; NxD's keyword
    tensor_model_parallel_group names the TP group."""
    group = nxd_state.get_tensor_model_parallel_group()
    layers = (
        ColumnParallelLinear(H, F, tensor_model_parallel_group=group),
        RowParallelLinear(F, H, tensor_model_parallel_group=group),
        GQAQKVColumnParallelLinear(H, [F, F], tensor_model_parallel_group=group),
    )
    for layer in layers:
        assert isinstance(layer, BaseParallelLinear)
        assert layer.tensor_parallel_group is group
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective
    _raises(
        lambda: ColumnParallelLinear(
            H, F, tensor_parallel_group=group, tensor_model_parallel_group=singles[0]
        ),
        "name different groups",
    )


def _raises(fn: Callable[[], object], *fragments: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as info:
        fn()
    for fragment in fragments[1:]:
        assert fragment in str(info.value), (fragment, str(info.value))


def check_bad_input() -> None:
    tp = nxd_state.get_tensor_model_parallel_size()
    _raises(lambda: ColumnParallelLinear(H, 3 * tp + 1), f"output_size({3 * tp + 1})", f"({tp})")
    _raises(lambda: RowParallelLinear(3 * tp + 1, H), f"input_size({3 * tp + 1})")
    _raises(lambda: RowParallelLinear(F, H, sequence_parallel_enabled=True), "input_is_parallel")
    _raises(lambda: ColumnParallelLinear(0, F), "input_size must be a positive int")
    sp = ColumnParallelLinear(H, F, sequence_parallel_enabled=True)
    _raises(lambda: sp(torch.randn(S, H)), "3-D input", "(8, 16)")
    _raises(lambda: ColumnParallelLinear(H, F)(torch.randn(B, S, H + 1)), "last dim", f"{H}")
    _raises(
        lambda: mappings.scatter_to_tensor_model_parallel_region(torch.randn(2, 4 * tp + 1)),
        f"size {4 * tp + 1}",
        "not divisible",
    )


CHECKS: dict[str, Callable[[], None]] = {
    "column_gather": lambda: check_column(gather_output=True, bias=True),
    "column_no_gather": lambda: check_column(gather_output=False, bias=True),
    "column_no_bias": lambda: check_column(gather_output=True, bias=False),
    "row_split_input": lambda: check_row(input_is_parallel=False),
    "row_input_is_parallel": lambda: check_row(input_is_parallel=True),
    "mlp": check_mlp,
    "mlp_sequence_parallel": check_mlp_sequence_parallel,
    "init_matches_tp1": check_init_matches_tp1,
    "attributes_meta_dtype_master": check_attributes_meta_dtype_master,
    "skip_bias_add": check_skip_bias_add,
    "bad_input": check_bad_input,
    "column_gather_bias_is_nxd": check_column_gather_bias_is_nxd,
    "column_stride_gather": check_column_stride_gather,
    "base_class_and_group_alias": check_base_class_and_group_alias,
}


def run_checks(tp: int) -> list[str]:
    """Every check on this rank, in order (see ``run_named_checks``)."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return run_named_checks(CHECKS, seed=100, context=f"tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_torch_nn(tp: int) -> None:
    """Every check of CHECKS on ``tp`` ranks (one spawn); a failure names its check."""
    assert run_distributed(run_checks, tp, tp) == [list(CHECKS)] * tp
