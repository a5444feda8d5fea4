"""gloo's reduce-scatter: an all-to-all and a local reduction in rank order, on 2 and 4 ranks.

gloo has no reduce-scatter of its own (torch runs ``reduce_scatter_tensor`` there as an
all-reduce of a copy), so ``collectives.reduce_scatter`` sends chunk j of X to rank j with one
``all_to_all_single`` and reduces what it received: the reduce-scatter's (n-1)/n·B on the wire
instead of the all-reduce's 2(n-1)/n·B. Checked: the result for sum, product, min and max
along several dims (small integers: exact), a bf16 sum equal to the rank-order sum bit for bit,
which torch.distributed functions ran (recorded by wrapping them), the counter, and the fall
back to ``reduce_scatter_tensor`` for an op without a local reduction (bitwise AND), counted
with the all-reduce gloo runs for it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from nxd_state import collectives as C
from nxd_state import count_collectives
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}
OPS = {"sum": ReduceOp.SUM, "product": ReduceOp.PRODUCT, "min": ReduceOp.MIN, "max": ReduceOp.MAX}
SHAPE = (4, 8)


def rank_input(rank: int) -> torch.Tensor:
    """Small distinct integers (products of 4 of them stay exact in float32)."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randint(-3, 4, SHAPE, generator=gen).float()


def bf16_input(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(SHAPE, generator=gen).bfloat16()


class _Spy:
    """Records which torch.distributed collectives ran, then delegates."""

    NAMES = ("all_to_all_single", "reduce_scatter_tensor", "all_reduce")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Spy:
        for name in self.NAMES:
            original = self._saved[name] = getattr(dist, name)

            def spy(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
                self.calls.append(_name)
                return _original(*args, **kw)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def scatter_every_op() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with count_collectives() as counter, _Spy() as spy:
        for name, op in OPS.items():
            for dim in (0, 1, -1):
                out[f"{name}/{dim}"] = C.reduce_scatter(rank_input(rank), dim=dim, op=op)
        out["bf16"] = C.reduce_scatter(bf16_input(rank), dim=1)
    out["calls"] = spy.calls
    out["counter"] = counter.as_dict()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_reduce_scatter_is_an_all_to_all_and_a_local_reduction(world: int) -> None:
    inputs = torch.stack([rank_input(r) for r in range(world)])
    reference = {
        "sum": inputs.sum(0),
        "product": inputs.prod(0),
        "min": inputs.amin(0),
        "max": inputs.amax(0),
    }
    bf16_sum = bf16_input(0)
    for r in range(1, world):
        bf16_sum = bf16_sum + bf16_input(r)  # bf16 additions in rank order
    for rank, out in enumerate(run_distributed(scatter_every_op, world)):
        for name, total in reference.items():
            for dim in (0, 1, -1):
                expected = total.chunk(world, dim=dim)[rank]
                torch.testing.assert_close(out[f"{name}/{dim}"], expected, **EXACT)
        got = out["bf16"]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, bf16_sum.chunk(world, dim=1)[rank])
        calls = len(OPS) * 3 + 1
        assert out["calls"] == ["all_to_all_single"] * calls
        fp32, bf16 = 4 * 32, 2 * 32
        payload = (calls - 1) * fp32 + bf16
        assert out["counter"] == {
            "reduce_scatter@world": {
                "calls": calls,
                "bytes": payload,
                "wire_bytes": (world - 1) / world * payload,
            }
        }


def scatter_bitwise_and() -> dict[str, Any]:
    rank = dist.get_rank()
    x = torch.tensor([0b1111, 0b0111, 0b1011, 0b1101], dtype=torch.int32) | (1 << (4 + rank))
    with count_collectives() as counter, _Spy() as spy:
        y = C.reduce_scatter(x, op=ReduceOp.BAND)
    return {"y": y, "calls": spy.calls, "counter": counter.as_dict()}


def test_an_op_without_a_local_reduction_uses_gloo_reduce_scatter_counted_as_all_reduce() -> None:
    world = 2
    for rank, out in enumerate(run_distributed(scatter_bitwise_and, world)):
        full = torch.tensor([0b1111, 0b0111, 0b1011, 0b1101], dtype=torch.int32)
        torch.testing.assert_close(out["y"], full.chunk(world)[rank], **EXACT)
        assert out["calls"][0] == "reduce_scatter_tensor"
        nbytes = 4 * 4
        assert out["counter"] == {
            "reduce_scatter@world": {
                "calls": 1,
                "bytes": nbytes,
                "wire_bytes": 2 * (world - 1) / world * nbytes,
            }
        }
