"""The MoE block in one process: experts against a Python loop over tokens, capacity and
deterministic tie-breaking, the auxiliary losses against their formulas, refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nxd_layers.moe import (
    ExpertMLPsCapacityFactor,
    MoE,
    MoESequenceParallelMode,
    RouterSinkhorn,
    RouterTopK,
    SharedExperts,
    expert_capacity,
    grouped_mm_supported,
    load_balancing_loss_func,
    router_z_loss_func,
)
from nxd_state.testing import load_sibling

M = load_sibling(__file__, "_moe")
EXPERTS, HIDDEN, TOP_K, tiny_moe = M.EXPERTS, M.HIDDEN, M.TOP_K, M.tiny_moe


def loop_reference(moe: MoE, x: torch.Tensor, cap: int | None) -> torch.Tensor:
    """out_t = sum over kept (t, e) of w_te * expert_e(x_t), one token at a time; an expert
    serves its first ``cap`` assignments in token order."""
    experts = moe.expert_mlps
    _logits, affinities, index = moe.router(x)
    served = [0] * EXPERTS
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        kept = []
        for j in range(TOP_K):
            e = int(index[t, j])
            if cap is None or served[e] < cap:
                kept.append(e)
            served[e] += 1
        weights = affinities[t, kept]
        if experts.normalize_top_k_affinities:
            weights = weights / weights.sum()
        for e, w in zip(kept, weights):
            gate, up = (x[t] @ experts.gate_up_proj.weight[e]).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ experts.down_proj.weight[e])
    return out


@pytest.mark.parametrize(
    ("capacity_factor", "act_fn", "normalize"),
    [(None, "softmax", False), (1.0, "softmax", False), (0.5, "sigmoid", True)],
)
def test_block_equals_loop_over_tokens(
    capacity_factor: float | None, act_fn: str, normalize: bool
) -> None:
    moe = tiny_moe(capacity_factor, act_fn=act_fn, normalize=normalize)
    x = torch.randn(12, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cap = None if capacity_factor is None else expert_capacity(12, TOP_K, EXPERTS, capacity_factor)
    (out, _) = moe(x)
    # float64, the same products summed in the same order per token up to bmm blocking: 1e-12.
    torch.testing.assert_close(out, loop_reference(moe, x, cap), rtol=1e-12, atol=1e-12)
    if capacity_factor == 0.5:
        assert moe.expert_mlps.last_dropped > 0


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_equal_the_padded_batch(
    capacity_factor: float | None, dtype: torch.dtype
) -> None:
    """``torch._grouped_mm`` over the rows sorted by expert (the default on CUDA; CPU runs the
    same interface, which is what CI can check) against the zero-padded ``bmm``: the output,
    the input's and every weight's gradient. Each row meets the same expert weights either
    way, only through another kernel, so the two agree to round-off of ``dtype`` (float32
    1e-5; bfloat16, an 8-bit mantissa over 16-term sums, 2e-2); a misrouted row moves values
    by O(1)."""
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    results = []
    for grouped in (True, False):
        moe = tiny_moe(capacity_factor, dtype=dtype)
        moe.expert_mlps.grouped_mm = grouped
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(12, HIDDEN, generator=gen).to(dtype).requires_grad_()
        out, _ = moe(x)
        out.float().square().sum().backward()
        grads = [p.grad for p in moe.expert_mlps.parameters()]
        results.append((out, x.grad, *grads))
    assert grouped_mm_supported(x, moe.expert_mlps.gate_up_proj.weight)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol)
    if capacity_factor is not None:
        assert moe.expert_mlps.last_dropped > 0


def test_grouped_products_are_refused_where_torch_lacks_them() -> None:
    moe = tiny_moe(None)  # float64: no grouped kernel, the default takes the padded bmm
    x = torch.randn(4, HIDDEN, dtype=torch.float64)
    assert not grouped_mm_supported(x, moe.expert_mlps.gate_up_proj.weight)
    moe(x)
    moe.expert_mlps.grouped_mm = True
    with pytest.raises(ValueError, match=r"grouped_mm=True: .*float64"):
        moe(x)


def test_ties_go_to_lower_expert_and_earlier_token() -> None:
    """All logits equal: every token picks experts 0 and 1; with capacity C each keeps the first
    C tokens, whatever the kernel (the same answer on every run)."""
    moe = tiny_moe(1.0)
    moe.is_test = True
    torch.nn.init.zeros_(moe.router.linear_router.weight)
    x = torch.randn(8, HIDDEN, dtype=torch.float64)
    out, _, index = moe(x)
    assert index.tolist() == [[0, 1]] * 8
    cap = expert_capacity(8, TOP_K, EXPERTS, 1.0)  # ceil(8 * 2 / 4) = 4
    assert cap == 4
    assert moe.expert_mlps.last_dropped == 8
    assert torch.all(out[cap:] == 0)
    assert torch.all(out[:cap].abs().sum(1) > 0)
    again, _, _ = moe(x)
    assert torch.equal(out, again)


def test_load_balancing_and_z_loss_formulas() -> None:
    logits = torch.randn(10, EXPERTS, dtype=torch.float64)
    probs = logits.softmax(-1)
    top = probs.topk(TOP_K).indices  # random floats: no ties
    counts = torch.zeros(EXPERTS, dtype=torch.float64)
    for row in top:
        counts[row] += 1
    # Switch/Mixtral: E / k * sum_e (count_e / T) * mean_t p_te.
    expected = EXPERTS / TOP_K * (counts / 10 * probs.mean(0)).sum()
    torch.testing.assert_close(load_balancing_loss_func(logits, EXPERTS, TOP_K), expected)
    expected_z = (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(router_z_loss_func(logits), expected_z)
    # Perfect balance with uniform probabilities gives 1.
    uniform = torch.zeros(8, EXPERTS, dtype=torch.float64)
    uniform_loss = load_balancing_loss_func(uniform, EXPERTS, EXPERTS)
    assert math.isclose(float(uniform_loss), 1.0)


def test_sinkhorn_router_balances_top1() -> None:
    torch.manual_seed(0)
    router = RouterSinkhorn(EXPERTS, 1, HIDDEN, dtype=torch.float64)
    x = torch.randn(64, HIDDEN, dtype=torch.float64) + 3.0  # skewed towards few experts
    _, affinities, index = router(x)
    assert index.shape == (64, 1)
    assert affinities.shape == (64, EXPERTS)
    balanced = torch.bincount(index[:, 0], minlength=EXPERTS)
    router.eval()
    plain = torch.bincount(router(x)[2][:, 0], minlength=EXPERTS)
    assert balanced.max() <= plain.max()
    with pytest.raises(NotImplementedError, match=r"top_k=2"):
        RouterSinkhorn(EXPERTS, 2, HIDDEN)


def test_shared_experts_are_added() -> None:
    moe = tiny_moe(None)
    shared = SharedExperts(HIDDEN, 8, gated=True, dtype=torch.float64)
    with_shared = MoE(moe.router, moe.expert_mlps, shared_experts=shared)
    x = torch.randn(5, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(with_shared(x)[0], moe(x)[0] + shared(x))


def test_refusals_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, num_experts=4\]"):
        RouterTopK(4, 5, HIDDEN)
    with pytest.raises(NotImplementedError, match=r"sequence_parallel_mode=EXIT_SP_ON_ENTRY"):
        ExpertMLPsCapacityFactor(
            4, 2, HIDDEN, 8, "silu", None, True, MoESequenceParallelMode.EXIT_SP_ON_ENTRY
        )
    with pytest.raises(ValueError, match=r"capacity_factor must be > 0"):
        ExpertMLPsCapacityFactor(4, 2, HIDDEN, 8, "silu", 0.0, True)
    moe = tiny_moe(None)
    with pytest.raises(NotImplementedError, match=r"sequence_parallel_enabled=True"):
        MoE(moe.router, moe.expert_mlps, sequence_parallel_enabled=True)
