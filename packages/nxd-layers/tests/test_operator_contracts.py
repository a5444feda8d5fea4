"""The ``nxd_layers`` operators keep torch's operator contract at TP = 2, including strides.

``torch.library.opcheck`` runs each operator for real and on fake tensors and compares the
outputs' metadata (shape, dtype, strides), checks the schema (no aliasing, no mutation) and
the autograd registration, and runs it through AOT autograd. A compiled graph lays out its
views by the fake implementation's strides: when a gather or reduce-scatter along the sequence
dim (dim 1 of Hugging Face's (B, S, H)) returned ``movedim``'s non-contiguous view while the
fake said contiguous, ``torch.compile`` of a decoder layer with sequence parallelism failed at
run time ("view size is not compatible with input tensor's size and stride"). Each case below
uses a dim > 0 or a dense non-contiguous input, the layouts that broke it.

Then the end-to-end form: a sequence-parallel MLP block in that layout, compiled with
``fullgraph=True`` (no graph break) through AOT autograd (``aot_eager``: the graph Inductor
would receive, without needing a C++ toolchain), gives the eager loss and every gradient
(nxd-trainer's tests do the same for a Hugging Face Llama's decoder layers). Tolerance: rtol
1e-5 / atol 1e-6, fp32; AOT autograd may reorder the same float32 operations, round-off of a
few 1e-7; a wrong layout or a lost reduction is off by O(1e-1).
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_state.testing import run_distributed


def _mismatches(names: tuple[str, ...], eager: tuple, compiled: tuple) -> list[str]:
    """One line per value of ``compiled`` not close to ``eager`` (see the tolerance above)."""
    bad = []
    for name, want, got in zip(names, eager, compiled, strict=True):
        try:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        except AssertionError as error:
            bad.append(f"{name}: {error}")
    return bad


def _assert_no_rank_failed(fn: Any) -> None:
    for rank, bad in enumerate(run_distributed(fn, 2)):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)


def _opcheck_cases() -> list[str]:
    import nxd_state
    from nxd_layers import _ops

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = _ops.group_key(nxd_state.get_parallel_state().tensor_parallel_group)
    torch.manual_seed(0)  # the same inputs on both ranks
    x = torch.randn(3, 4, 6, requires_grad=True)
    # dense but not contiguous: strides (1, 3, 12)
    transposed = torch.randn(6, 4, 3).permute(2, 1, 0).detach().requires_grad_(True)
    logits = torch.randn(2, 5, 8, requires_grad=True)  # the local 8 of a 16-column vocabulary
    labels = torch.randint(0, 16, (2, 5))
    labels[0, 0] = -100
    cases: list[tuple[str, Any, tuple[Any, ...]]] = [
        ("copy_to_tp transposed", _ops.copy_to_tp, (transposed, group, None)),
        ("reduce_from_tp transposed", _ops.reduce_from_tp, (transposed, group)),
        ("split dim 1", _ops.split, (x, 1, group)),
        ("gather dim 1", _ops.gather, (x, 1, group, True, None)),
        ("gather dim 2 transposed", _ops.gather, (transposed, 2, group, False, None)),
        ("reduce_scatter dim 1", _ops.reduce_scatter, (x, 1, group, None)),
        ("reduce_scatter dim 1 transposed", _ops.reduce_scatter, (transposed, 1, group, None)),
    ]
    bad = []
    for name, op, args in cases:
        try:
            torch.library.opcheck(op, args)
        except Exception as error:  # every case runs on every rank, so the collectives pair
            bad.append(f"{name}: {error}")
    # The loss operator returns its softmax and masks for its own backward, which rewrites the
    # saved softmax in place into dL/dz (Megatron's memory saving) and differentiates the loss
    # only. opcheck's AOT test backpropagates through every output, a use the operator does not
    # offer; the loss's compiled backward is checked against eager below instead.
    try:
        torch.library.opcheck(
            _ops.parallel_cross_entropy,
            (logits, labels, 0.1, -100, group),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )
    except Exception as error:
        bad.append(f"parallel_cross_entropy: {error}")
    return bad


def test_operators_pass_opcheck_at_tp2() -> None:
    _assert_no_rank_failed(_opcheck_cases)


class _SequenceParallelMLP(torch.nn.Module):
    """y = x + RS_1(relu(AG_1(x) W1_r^T) W2_r^T), sequence sharded along dim 1 of (B, S, H).

    AG_1 all-gathers the sequence (dim 1), W1 is split by rows (column parallel), W2 by columns
    (row parallel), RS_1 sums over TP and keeps this rank's sequence chunk: the Hugging Face
    layout of sequence parallelism, where the gather and reduce-scatter run along dim 1."""

    def __init__(self, tp: int, rank: int) -> None:
        super().__init__()
        full1 = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        full2 = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
        self.w1 = torch.nn.Parameter(full1.chunk(tp, 0)[rank].clone())
        self.w2 = torch.nn.Parameter(full2.chunk(tp, 1)[rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from nxd_layers.mappings import (
            gather_from_sequence_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        whole = gather_from_sequence_parallel_region(x, 1)
        partial = torch.relu(whole @ self.w1.t()) @ self.w2.t()
        return x + reduce_scatter_to_sequence_parallel_region(partial, 1)


def _compiled_loss_matches_eager() -> list[str]:
    """mean CE(x W_r^T, y) over a vocabulary split in two, compiled (fullgraph, dynamic
    shapes) and eager: the loss and dL/dW."""
    import nxd_state
    from nxd_layers import parallel_cross_entropy

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))

    def loss_of(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return parallel_cross_entropy(x @ weight.t(), labels, 0.1).mean()

    x, labels = torch.randn(2, 5, 4), torch.randint(0, 16, (2, 5))
    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager", dynamic=True)
    results = []
    for fn in (loss_of, compiled):
        weight.grad = None
        loss = fn(x, labels)
        loss.backward()
        results.append((loss.detach(), weight.grad))
    return _mismatches(("loss", "dW"), *results)


def test_parallel_cross_entropy_compiles_and_matches_eager() -> None:
    _assert_no_rank_failed(_compiled_loss_matches_eager)


def _compiled_matches_eager() -> list[str]:
    import nxd_state
    from nxd_layers.mappings import scatter_to_sequence_parallel_region

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    state = nxd_state.get_parallel_state()
    tp, rank = state.tensor_parallel_size, state.tensor_parallel_rank
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        block = _SequenceParallelMLP(tp, rank)
        run = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        local = scatter_to_sequence_parallel_region(x, 1)
        loss = run(local).square().sum()
        loss.backward()
        assert x.grad is not None
        results.append((loss.detach(), x.grad, block.w1.grad, block.w2.grad))
    return _mismatches(("loss", "dx", "dW1", "dW2"), *results)


def test_sequence_parallel_block_compiles_fullgraph_and_matches_eager() -> None:
    _assert_no_rank_failed(_compiled_matches_eager)
