"""Ring and all-to-all attention against one process's SDPA: outputs and every gradient.

Each rank attends with its zigzag slice of q, k, v; the caller reassembles the slices of the
output and of dq, dk, dv and compares them with ``scaled_dot_product_attention`` on the whole
sequence in this process. Grouped-query heads (Hq = 2 Hkv), causal and not.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nxd_layers.context_parallel import (
    all_to_all_attention,
    check_sequence_length,
    context_parallel_indices,
    gather_from_context_parallel,
    ring_attention,
    split_for_context_parallel,
)
from nxd_state.testing import run_distributed

B, HQ, HKV, S, D = 2, 8, 4, 32, 8
VARIANTS = [  # (name, algorithm, kernel, causal, dtype)
    ("ring-math-causal", "ring", "math", True, torch.float64),
    ("ring-flash-causal", "ring", "flash_cpu", True, torch.float64),
    ("ring-math-full", "ring", "math", False, torch.float64),
    ("ring-flash-causal-fp32", "ring", "flash_cpu", True, torch.float32),
    ("a2a-causal", "all_to_all", None, True, torch.float64),
    ("a2a-full", "all_to_all", None, False, torch.float64),
]


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64)  # loss = sum(w * out)
    return tuple(t.to(dtype) for t in (q, k, v, w))


def reference(causal: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    q, k, v, w = (t.requires_grad_(i < 3) for i, t in enumerate(inputs(dtype)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    (w * out).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def run_variants() -> dict[str, list[torch.Tensor]]:
    group = dist.group.WORLD
    results = {}
    for name, algorithm, kernel, causal, dtype in VARIANTS:
        zigzag = causal  # non-causal variants exercise the contiguous split
        q, k, v, w = (
            split_for_context_parallel(t, group, dim=2, zigzag=zigzag) for t in inputs(dtype)
        )
        for t in (q, k, v):
            t.requires_grad_(True)
        if algorithm == "ring":
            out = ring_attention(q, k, v, group, causal=causal, kernel=kernel)
        else:
            out = all_to_all_attention(q, k, v, group, causal=causal, zigzag=zigzag)
        (w * out).sum().backward()
        # The gathered output is the whole sequence on every rank, in natural order.
        full = gather_from_context_parallel(out.detach(), group, dim=2, zigzag=zigzag)
        results[name] = [full, q.grad, k.grad, v.grad]
    return results


# float64 inputs: the ring merges per-block results (different summation order than one
# softmax), so agreement is to float64 rounding, ~1e-15 relative; 1e-10 leaves margin for the
# accumulated exp/log of the merge. float32: the same argument at float32's epsilon (~1e-7),
# summed over up to 4 blocks, so 1e-5.
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-10}, torch.float32: {"rtol": 1e-5, "atol": 1e-5}}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_one_process(cp: int) -> None:
    per_rank = run_distributed(run_variants, cp)
    for name, _, _, causal, dtype in VARIANTS:
        want = reference(causal, dtype)
        zigzag = causal
        for rank, results in enumerate(per_rank):
            full, dq, dk, dv = results[name]
            torch.testing.assert_close(full, want[0], **TOL[dtype], msg=f"{name} out rank {rank}")
            index = context_parallel_indices(S, cp, rank, zigzag)
            for got, ref, what in ((dq, want[1], "dq"), (dk, want[2], "dk"), (dv, want[3], "dv")):
                torch.testing.assert_close(
                    got, ref.index_select(2, index), **TOL[dtype], msg=f"{name} {what} rank {rank}"
                )


def test_zigzag_indices_balance_causal_work() -> None:
    """Rank r holds chunks r and 2n-1-r: the causal work (sum of positions + 1) is equal."""
    n, s = 4, 64
    work = [int((context_parallel_indices(s, n, r) + 1).sum()) for r in range(n)]
    assert len(set(work)) == 1
    assert sorted(torch.cat([context_parallel_indices(s, n, r) for r in range(n)]).tolist()) == (
        list(range(s))
    )


def test_sequence_not_divisible_names_both_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"sequence length 30 is not divisible by 2 x context_parallel_size\(4\) = 8",
    ):
        check_sequence_length(30, 4)
    with pytest.raises(
        ValueError, match=r"sequence length 30 is not divisible by context_parallel_size\(4\)"
    ):
        check_sequence_length(30, 4, zigzag=False)


def a2a_with_too_few_heads() -> str:
    q = torch.zeros(1, 2, 4, 8)
    try:
        all_to_all_attention(q, q, q, dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"


def test_all_to_all_refuses_heads_not_divisible() -> None:
    for message in run_distributed(a2a_with_too_few_heads, 4):
        assert "query heads (2) and key/value heads (2) must both be divisible" in message
