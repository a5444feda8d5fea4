"""Expert parallelism: the tiny MoE block at EP=2 and EP=4 (gloo) equals the one-process block.

Each rank routes its own slice of the batch (batch-first, split over the batch dimension, so
the ranks' tokens concatenated in EP-rank order are the one-process batch). Compared on every
rank: outputs, the load-balancing and z losses (over the EP group), the input gradient, every
expert weight's gradient (gathered over EP) and the router's gradient (summed over EP: each
rank's loss holds its own tokens, the one-process loss all of them).

Tolerance: float64 everywhere; the parallel run computes the same products, only summed in
another order (the loss statistics summed per rank then all-reduced; bmm over a different
number of padded rows), so results agree to a few ulps of float64: 1e-10 is far above that
and far below any real mistake (a wrong or dropped token moves values by ~1e-1). One case runs
in float32 through torch's grouped products (``ExpertMLPs.grouped_mm=True``: no float64
kernel) on both sides: the same per-row products in other groupings, so a few float32 ulps
(~1e-7 relative) reordered: rtol 1e-5 / atol 1e-6, still far below a real mistake.
"""

from __future__ import annotations

import pytest
import torch

import nxd_state as ps
from nxd_layers.moe import load_balancing_loss_func, router_z_loss_func
from nxd_state import collectives
from nxd_state.testing import load_sibling, run_distributed

M = load_sibling(__file__, "_moe")
TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64, reordered sums only: see the module docstring
TOL32 = {"rtol": 1e-5, "atol": 1e-6}  # float32, grouped products: see the module docstring
BATCH_PER_RANK, SEQ = 2, 3


def _losses(moe, x, g, group):  # type: ignore[no-untyped-def]
    out, logits = moe(x)
    aux = load_balancing_loss_func(logits, M.EXPERTS, M.TOP_K, group=group)
    z = router_z_loss_func(logits, group=group)
    return out, aux, z


def ep_parity(
    ep: int,
    capacity_factor: float | None,
    act_fn: str,
    normalize: bool,
    tp: int = 1,
    dtype: torch.dtype = torch.float64,
) -> int:
    """Runs on each of ``ep * tp`` ranks; asserts parity, returns this rank's dropped count.
    float32: the experts run torch's grouped products (float64: the padded bmm)."""
    gen = torch.Generator().manual_seed(7)
    x_full = torch.randn(ep * BATCH_PER_RANK, SEQ, M.HIDDEN, dtype=dtype, generator=gen)
    g_full = torch.randn(x_full.shape, dtype=dtype, generator=gen)
    grouped = dtype == torch.float32
    tol = TOL32 if grouped else TOL

    # One process, the whole batch (built before any parallel state: no EP group).
    ref = M.tiny_moe(capacity_factor, act_fn=act_fn, normalize=normalize, dtype=dtype)
    ref.expert_mlps.grouped_mm = grouped
    x_ref = x_full.clone().requires_grad_()
    out_ref, aux_ref, z_ref = _losses(ref, x_ref, g_full, None)
    ((out_ref * g_full).sum() + aux_ref + 0.1 * z_ref).backward()

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    group = ps.get_expert_model_parallel_group()
    rank = ps.get_expert_model_parallel_rank()
    moe = M.tiny_moe(capacity_factor, act_fn=act_fn, normalize=normalize, dtype=dtype)
    experts = moe.expert_mlps
    experts.grouped_mm = grouped
    local = M.EXPERTS // ep
    mine = slice(rank * local, (rank + 1) * local)
    # TP rank t holds intermediate columns t of the gate and of the up projection, rows t of
    # the down projection.
    t, width = ps.get_tensor_model_parallel_rank(), M.INTERMEDIATE // tp
    inner = torch.arange(t * width, (t + 1) * width)
    tp_slices = {
        "gate_up_proj": (2, torch.cat([inner, inner + M.INTERMEDIATE])),
        "down_proj": (1, inner),
    }
    # Weights drawn full from the seed and sliced: EP and TP build the one-process layer.
    torch.testing.assert_close(
        experts.gate_up_proj.weight,
        ref.expert_mlps.gate_up_proj.weight[mine].index_select(2, tp_slices["gate_up_proj"][1]),
    )
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    x = x_full[rows].clone().requires_grad_()
    out, aux, z = _losses(moe, x, g_full[rows], group)
    # Every rank's loss holds its tokens and 1/ep of the (global, identical) auxiliary losses.
    ((out * g_full[rows]).sum() + (aux + 0.1 * z) / ep).backward()

    torch.testing.assert_close(out, out_ref[rows], **tol)
    torch.testing.assert_close(aux, aux_ref, **tol)
    torch.testing.assert_close(z, z_ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad[rows], **tol)
    for name, (dim, index) in tp_slices.items():
        grad = getattr(experts, name).weight.grad
        every_expert = collectives.all_gather(grad, group, dim=0)  # this TP rank's shard of each
        expected = getattr(ref.expert_mlps, name).weight.grad.index_select(dim, index)
        torch.testing.assert_close(every_expert, expected, **tol)
    router_grad = collectives.all_reduce(moe.router.linear_router.weight.grad.clone(), group)
    torch.testing.assert_close(router_grad, ref.router.linear_router.weight.grad, **tol)
    dropped = torch.tensor([experts.last_dropped])
    collectives.all_reduce(dropped, group)
    assert int(dropped) == ref.expert_mlps.last_dropped
    ps.destroy_model_parallel()
    return experts.last_dropped


@pytest.mark.parametrize(
    ("ep", "capacity_factor", "act_fn", "normalize"),
    [
        (2, None, "softmax", False),
        (2, 1.0, "softmax", False),
        (2, 0.75, "sigmoid", True),
        (4, None, "softmax", False),
        (4, 1.0, "softmax", False),
    ],
)
def test_expert_parallel_equals_one_process(
    ep: int, capacity_factor: float | None, act_fn: str, normalize: bool
) -> None:
    dropped = run_distributed(ep_parity, ep, ep, capacity_factor, act_fn, normalize)
    if capacity_factor is None:
        assert dropped == [0] * ep
    else:  # the capacity really binds, so the global tie order is exercised
        assert sum(dropped) > 0


def test_grouped_products_at_ep2_equal_one_process() -> None:
    """float32 through ``torch._grouped_mm`` (dropless): EP=2 equals the one-process block."""
    dropped = run_distributed(ep_parity, 2, 2, None, "softmax", False, 1, torch.float32)
    assert dropped == [0, 0]


def test_tensor_parallel_inside_experts_with_ep() -> None:
    """TP2 x EP2 on 4 ranks (EP groups [0, 2], [1, 3]): each TP rank a partial sum of every
    expert, capacity mode."""
    dropped = run_distributed(ep_parity, 4, 2, 1.0, "softmax", False, 2)
    assert dropped[0] == dropped[1]  # the two TP ranks of one DP rank route alike
    assert sum(dropped) > 0


def ep_ties(ep: int) -> tuple[list[list[int]], int, bool]:
    """All logits equal: every token picks experts 0 and 1; capacity keeps the first tokens of
    the EP group's batch (rank 0's), whatever rank computes them."""
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    moe = M.tiny_moe(1.0)
    moe.is_test = True
    torch.nn.init.zeros_(moe.router.linear_router.weight)
    x = torch.randn(4, M.HIDDEN, dtype=torch.float64)
    out, _, index = moe(x)
    kept_rows = bool(torch.all(out.abs().sum(1) > 0))
    ps.destroy_model_parallel()
    return index.tolist(), moe.expert_mlps.last_dropped, kept_rows


def test_ties_are_broken_by_global_token_order() -> None:
    # 8 tokens over 2 ranks, capacity ceil(8 * 2 * 1.0 / 4) = 4 per expert: experts 0 and 1
    # each take the 4 tokens of rank 0; rank 1's 8 assignments are all dropped.
    (index0, dropped0, kept0), (index1, dropped1, kept1) = run_distributed(ep_ties, 2, 2)
    assert index0 == index1 == [[0, 1]] * 4
    assert (dropped0, kept0) == (0, True)
    assert dropped1 == 8
    assert not kept1


def ep_grad_norm_and_sync() -> tuple[float, float, list[float]]:
    """World 4, EP 2 (expert-DP groups [0, 2] and [1, 3]): the gradient norm of the sharded
    layer is the full layer's; the expert pass of ``bucket_allreduce_gradients`` sums over the
    ranks holding the same experts and divides by DP (the all-to-all backward already summed
    the EP group's tokens: a mean over expert-DP would be EP times too large)."""
    from nxd_layers import bucket_allreduce_gradients, get_grad_norm

    gen = torch.Generator().manual_seed(3)
    full = M.tiny_moe(None)
    grads = {
        name: torch.randn(p.shape, dtype=p.dtype, generator=gen)
        for name, p in full.named_parameters()
    }
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()]))
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    moe = M.tiny_moe(None)
    rank = ps.get_expert_model_parallel_rank()
    for name, param in moe.named_parameters():
        grad = grads[name]
        param.grad = grad[rank * 2 : rank * 2 + 2].clone() if "expert_mlps" in name else grad
    norm = get_grad_norm(list(moe.parameters()))
    marker = torch.full((3,), float(torch.distributed.get_rank()))
    bucket_allreduce_gradients([marker], reduce_over_ep_group=True)
    ps.destroy_model_parallel()
    return float(norm), float(expected), marker.tolist()


def test_grad_norm_and_expert_gradient_sync() -> None:
    results = run_distributed(ep_grad_norm_and_sync, 4)
    for rank, (norm, expected, marker) in enumerate(results):
        # get_grad_norm returns a float32 total (its documented accumulator): float32's
        # relative precision (6e-8) times a few additions; a missing expert shard would be ~30%.
        assert abs(norm - expected) <= 1e-6 * expected
        edp_group = [0, 2] if rank % 2 == 0 else [1, 3]
        assert marker == [sum(edp_group) / 4] * 3  # Σ over expert-DP / DP (= 4)
