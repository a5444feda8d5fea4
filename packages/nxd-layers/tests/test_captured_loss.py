"""``parallel_cross_entropy`` captured by ``torch.export``: one operator, its backward kept.

Eagerly the loss is an autograd Function (TP > 1) or torch's fused kernel (TP = 1); captured,
it is the ``nxd_layers::parallel_cross_entropy`` operator whose registered backward is the
Function's. The exported graph, run on inputs of another batch and sequence size (the
dimensions are dynamic), gives eager's loss and gradient. Tolerance: at TP = 2 both routes run
the same kernel (exact up to autograd's accumulation order, rtol 1e-6); at TP = 1 eager runs
``F.cross_entropy``, another float32 log-sum-exp (rtol 1e-5, atol 1e-6; a lost backward or a
missing TP reduction is off by O(1)).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nxd_state
from nxd_layers import parallel_cross_entropy
from nxd_state.testing import run_distributed

VOCAB, HIDDEN = 16, 4


class _Head(nn.Module):
    """loss = mean_t CE(x_t W_r^T, y_t) over vocabulary shard r (label smoothing 0.1)."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB // tp, HIDDEN))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = x @ self.weight.t()  # (B, S, V / tp)
        return parallel_cross_entropy(logits, labels, 0.1).mean()


def _exported(
    module: nn.Module, x: torch.Tensor, labels: torch.Tensor
) -> torch.export.ExportedProgram:
    dims = torch.export.Dim.AUTO
    dynamic = {"x": {0: dims, 1: dims}, "labels": {0: dims, 1: dims}}
    return torch.export.export(module, (x, labels), strict=False, dynamic_shapes=dynamic)


def captured_vs_eager(tp: int) -> dict[str, object]:
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    rank = nxd_state.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(VOCAB, HIDDEN, generator=gen)
    eager = _Head(tp)
    with torch.no_grad():
        eager.weight.copy_(full.chunk(tp)[rank])
    # A meta-device model with dynamic sizes, as a pipeline captures it.
    with torch.device("meta"):
        lazy = _Head(tp)
    meta_program = _exported(
        lazy,
        torch.ones(2, 4, HIDDEN, device="meta"),
        torch.ones(2, 4, dtype=torch.long, device="meta"),
    )
    program = _exported(eager, torch.randn(2, 4, HIDDEN), torch.randint(0, VOCAB, (2, 4)))
    captured = program.module()
    x = torch.randn(3, 5, HIDDEN, generator=gen)  # other sizes than the export's
    labels = torch.randint(0, VOCAB, (3, 5), generator=gen)
    labels[0, 0] = -100  # ignored
    expected = eager(x, labels)
    expected.backward()
    loss = captured(x, labels)
    loss.backward()
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    meta_targets = [str(n.target) for n in meta_program.graph.nodes if n.op == "call_function"]
    return {
        "loss": (loss.detach(), expected.detach()),
        "grad": (captured.weight.grad, eager.weight.grad),
        "ops": targets,
        "meta_ops": meta_targets,
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_captured_loss_keeps_its_backward(tp: int) -> None:
    tol = {"rtol": 1e-6, "atol": 1e-7} if tp > 1 else {"rtol": 1e-5, "atol": 1e-6}
    for result in run_distributed(captured_vs_eager, tp, tp):
        op = "nxd_layers.parallel_cross_entropy.default"
        assert op in result["ops"]
        assert op in result["meta_ops"]
        torch.testing.assert_close(*result["loss"], **tol)
        torch.testing.assert_close(*result["grad"], **tol)
