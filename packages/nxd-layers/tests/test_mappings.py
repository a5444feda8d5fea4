"""Each mapping's forward and its backward (the dual collective) against their definitions.

Inputs and upstream gradients are small integers in float32, distinct per rank, so sums are
exact: every comparison is exact (rtol=atol=0).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import nxd_state
from nxd_layers import mappings as M
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}
SHAPE = (4, 4, 8)  # (S, B, H) or (B, S, H): every dim divisible by 2 and 4


def _value(rank: int, salt: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32).reshape(shape) % 7) + 10 * rank + salt


class _Apply(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _exported(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.nn.Module:
    """``fn`` captured by ``torch.export``: one nxd_layers operator, its backward registered."""
    program = torch.export.export(_Apply(fn), (x,), strict=False)
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert any(str(op).startswith("nxd_layers.") for op in ops), ops
    return program.module()


def _forward_backward(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    upstream: torch.Tensor,
    route: str = "eager",
) -> tuple[torch.Tensor, torch.Tensor]:
    if route == "export":
        fn = _exported(fn, x)
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(upstream)
    return y.detach(), x.grad


def run_mappings(tp: int, seq_dim: int, route: str = "eager") -> dict[str, object]:
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    rank = dist.get_rank()
    full, shard_last = _value(rank, 0), _value(rank, 0, (*SHAPE[:-1], SHAPE[-1] // tp))
    seq_shape = list(SHAPE)
    seq_shape[seq_dim] //= tp
    shard_seq = _value(rank, 0, tuple(seq_shape))
    up_full, up_last, up_seq = (
        _value(rank, 3),
        _value(rank, 3, shard_last.shape),
        _value(rank, 3, shard_seq.shape),
    )
    up_channels = _value(rank, 3, (SHAPE[0], SHAPE[1] // tp, SHAPE[2]))
    return {
        "bad_input": _bad_input_messages() if route == "eager" else [],
        "copy": _forward_backward(
            M.copy_to_tensor_model_parallel_region, full, up_full, route=route
        ),
        "reduce": _forward_backward(
            M.reduce_from_tensor_model_parallel_region, full, up_full, route=route
        ),
        "scatter": _forward_backward(
            M.scatter_to_tensor_model_parallel_region, full, up_last, route=route
        ),
        "gather": _forward_backward(
            M.gather_from_tensor_model_parallel_region, shard_last, up_full, route=route
        ),
        "sp_scatter": _forward_backward(
            lambda x: M.scatter_to_sequence_parallel_region(x, seq_dim),  # NxD's order
            full,
            up_seq,
            route=route,
        ),
        "sp_gather": _forward_backward(
            lambda x: M.gather_from_sequence_parallel_region(x, seq_dim, True, None),
            shard_seq,
            up_full,
            route=route,
        ),
        "sp_gather_replicated": _forward_backward(
            lambda x: M.gather_from_sequence_parallel_region(
                x, sequence_dimension=seq_dim, to_model_parallel=False
            ),
            shard_seq,
            up_full,
            route=route,
        ),
        "sp_reduce_scatter": _forward_backward(
            lambda x: M.reduce_scatter_to_sequence_parallel_region(x, sequence_dimension=seq_dim),
            full,
            up_seq,
            route=route,
        ),
        "gather_with_dim": _forward_backward(
            lambda x: M.gather_from_tensor_model_parallel_region_with_dim(x, seq_dim),
            shard_seq,
            up_full,
            route=route,
        ),
        "reduce_scatter_with_dim": _forward_backward(
            lambda x: M.reduce_scatter_to_tensor_model_parallel_region_with_dim(x, seq_dim),
            full,
            up_seq,
            route=route,
        ),
        "channels_scatter": _forward_backward(
            M.scatter_input_channels_to_tensor_model_parallel_region, full, up_channels, route=route
        ),
    }


@pytest.mark.parametrize(
    ("tp", "seq_dim", "route"), [(2, 0, "eager"), (4, 1, "eager"), (2, 1, "export")]
)
def test_mappings_forward_and_dual_backward(tp: int, seq_dim: int, route: str) -> None:
    """Every mapping's forward and backward on every rank, eagerly (autograd Functions) and as
    a graph captured by ``torch.export`` (operators with registered backward, which must give
    the same values); bad shapes rejected by name."""
    results = run_distributed(run_mappings, tp, tp, seq_dim, route)
    seq_shape = list(SHAPE)
    seq_shape[seq_dim] //= tp
    xs = [_value(r, 0) for r in range(tp)]
    ups = [_value(r, 3) for r in range(tp)]
    shards_last = [_value(r, 0, (*SHAPE[:-1], SHAPE[-1] // tp)) for r in range(tp)]
    ups_last = [_value(r, 3, (*SHAPE[:-1], SHAPE[-1] // tp)) for r in range(tp)]
    shards_seq = [_value(r, 0, tuple(seq_shape)) for r in range(tp)]
    ups_seq = [_value(r, 3, tuple(seq_shape)) for r in range(tp)]
    ups_channels = [_value(r, 3, (SHAPE[0], SHAPE[1] // tp, SHAPE[2])) for r in range(tp)]
    if route == "eager":
        lines = results[0]["bad_input"]
        assert "size 3" in lines[0]
        assert f"not divisible by {tp}" in lines[0]
        assert "size 3" in lines[1]
        assert "sequence_dimension=2 is out of range for a 2-D input" in lines[2]
        assert "sequence_dimension must be an int" in lines[3]
        assert "NxD's argument order: input_, sequence_dimension" in lines[3]
    for r, out in enumerate(results):
        expected = {
            # identity forward, all-reduce backward
            "copy": (xs[r], sum(ups)),
            # all-reduce forward, identity backward
            "reduce": (sum(xs), ups[r]),
            # split the last dim forward, all-gather it backward
            "scatter": (xs[r].chunk(tp, -1)[r], torch.cat(ups_last, -1)),
            # all-gather the last dim forward, split backward
            "gather": (torch.cat(shards_last, -1), ups[r].chunk(tp, -1)[r]),
            # split the sequence forward, all-gather backward
            "sp_scatter": (xs[r].chunk(tp, seq_dim)[r], torch.cat(ups_seq, seq_dim)),
            # all-gather the sequence forward, reduce-scatter backward
            "sp_gather": (torch.cat(shards_seq, seq_dim), sum(ups).chunk(tp, seq_dim)[r]),
            # ... or split backward when every rank's gradient is whole
            "sp_gather_replicated": (torch.cat(shards_seq, seq_dim), ups[r].chunk(tp, seq_dim)[r]),
            # reduce-scatter the sequence forward, all-gather backward
            "sp_reduce_scatter": (sum(xs).chunk(tp, seq_dim)[r], torch.cat(ups_seq, seq_dim)),
            # NxD's *_with_dim: the same collectives along any dim
            "gather_with_dim": (torch.cat(shards_seq, seq_dim), ups[r].chunk(tp, seq_dim)[r]),
            "reduce_scatter_with_dim": (
                sum(xs).chunk(tp, seq_dim)[r],
                torch.cat(ups_seq, seq_dim),
            ),
            # split dim 1 (image channels) forward, all-gather it backward
            "channels_scatter": (xs[r].chunk(tp, 1)[r], torch.cat(ups_channels, 1)),
        }
        for name, (forward, backward) in expected.items():
            torch.testing.assert_close(out[name][0], forward, **EXACT, msg=f"{name} forward")
            torch.testing.assert_close(out[name][1], backward, **EXACT, msg=f"{name} backward")


def _bad_input_messages() -> list[str]:
    messages = []
    for call in (
        lambda: M.scatter_to_tensor_model_parallel_region(torch.ones(2, 3)),
        lambda: M.scatter_to_sequence_parallel_region(torch.ones(3, 2), sequence_dimension=0),
        lambda: M.gather_from_sequence_parallel_region(torch.ones(2, 2), sequence_dimension=2),
        # nxd's old order (input, group, dim): NxD's second argument is the sequence dim
        lambda: M.reduce_scatter_to_sequence_parallel_region(
            torch.ones(4, 2), nxd_state.get_tensor_model_parallel_group()
        ),
    ):
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as error:
            messages.append(str(error))
    return messages
