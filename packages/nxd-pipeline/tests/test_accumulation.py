"""Gradient accumulation over several ``run_train`` calls equals one process accumulating the
same batches: every gradient, with weights tied across pipeline ranks and with DP averaging.

Each ``run_train`` reduces exactly the gradient it produced (tied weights summed over the
pipeline group, then averaged over DP when the pipeline does that), so k calls leave
``sum_k g_k`` whatever was accumulated before; reducing the whole ``.grad`` again would count
earlier calls' tied-weight contributions twice. Tolerance: fp32, and the pipeline sums
per-microbatch gradients in a different order than one full-batch backward: round-off only,
rtol 1e-5 / atol 1e-6 (gradients are O(1e-2..1); counting a call twice is off by ~100 %).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import nxd_state
from nxd_pipeline import NxDPPModel
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}
M = 2  # microbatches per run_train


class Fp32Store:
    """What an optimizer's fp32 gradient accumulation does (nxd-optim's ``GradientStore``): a
    post-accumulate-grad hook moves every new gradient into a float32 buffer and frees
    ``.grad``. The pipeline's reductions must still reach what it collects."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.buffers = {param: torch.zeros_like(param) for param in params}
        for param in params:
            param.register_post_accumulate_grad_hook(self._take)

    def _take(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.buffers[param].add_(param.grad)
            param.grad = None

    def grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        assert param.grad is None, "the hook left a gradient behind"
        return self.buffers[param]


def _batches(n: int, rows: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (rows, 8), generator=generator) for _ in range(n)]


def _reference_grads(reference: torch.nn.Module, batches: list[torch.Tensor]) -> dict:
    """One process: loss(batch).backward() for each batch, gradients summed by autograd."""
    reference.zero_grad()
    for batch in batches:
        reference(batch, batch).backward()
    return {name: p.grad.clone() for name, p in reference.named_parameters(remove_duplicate=False)}


def _compare(model: NxDPPModel, expected: dict, label: str, store: Fp32Store | None) -> int:
    count = 0
    for name, param in model.local_named_parameters():
        grad = store.grad(param) if store is not None else param.grad
        assert grad is not None, f"{label}: {name} got no gradient"
        torch.testing.assert_close(grad, expected[name], **TOL, msg=f"{label}: {name}")
        count += 1
    return count


def _accumulated(
    schedule: str, *, calls: int, store: bool = False, late: bool = False, **kwargs: Any
) -> int:
    """``calls`` run_train calls on this rank's share of ``calls`` global batches. ``late``:
    ``kwargs`` are set as attributes after construction (a wrapper claiming the DP reduction
    later, as the trainer's optimizer does), not passed to the constructor."""
    state = nxd_state.get_parallel_state()
    dp, rank = state.data_parallel_size, state.data_parallel_rank
    torch.manual_seed(0)
    reference = TinyGPT(layers=4, tie_embeddings=True)
    batches = _batches(calls, 2 * M * dp)
    model = NxDPPModel(
        copy.deepcopy(reference),
        transformer_layer_cls=Block,
        num_microbatches=M,
        pipeline_cuts=["h.1"],
        schedule=schedule,
        **({} if late else kwargs),
    )
    for name, value in kwargs.items() if late else ():
        setattr(model, name, value)
    fp32 = Fp32Store([p for _, p in model.local_named_parameters()]) if store else None
    for batch in batches:
        mine = batch.chunk(dp)[rank]
        model.run_train(input_ids=mine, labels=mine)
    reduces_dp = not (kwargs.get("use_optimizer_wrapper") or kwargs.get("use_zero1_optimizer"))
    if reduces_dp:  # full batches, averaged over DP = the global batch's mean loss
        expected = _reference_grads(reference, batches)
    else:  # gradients stay this DP rank's own (tied weights still summed over PP)
        expected = _reference_grads(reference, [b.chunk(dp)[rank] for b in batches])
    label = f"{schedule} x{calls} dp{dp} store={store} {sorted(kwargs)}"
    return _compare(model, expected, label, fp32)


def _tied_copies_start_equal_and_count_once() -> int:
    """The last rank's copy of the tied weight starts different (ranks built their models
    apart): the first step gives it the first rank's value, as NxD syncs them. Its gradient
    is then summed over both ranks, and the copy that is not the first is marked ``shared``,
    so the global gradient norm counts the tied weight once, as one process does."""
    from nxd_layers import get_grad_norm

    state = nxd_state.get_parallel_state()
    torch.manual_seed(0)
    reference = TinyGPT(layers=4, tie_embeddings=True)
    mine = copy.deepcopy(reference)
    if state.pipeline_parallel_rank == 1:
        with torch.no_grad():
            mine.wte.weight.mul_(-2.0)  # overwritten by rank 0's value at the first step
    model = NxDPPModel(mine, transformer_layer_cls=Block, num_microbatches=M, pipeline_cuts=["h.1"])
    (batch,) = _batches(1, 2 * M)
    model.run_train(input_ids=batch, labels=batch)
    expected = _reference_grads(reference, [batch])
    count = _compare(model, expected, "tied copies synced", None)
    values = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param, values[name], rtol=0, atol=0, msg=f"value {name}")
    marked = [n for n, p in model.local_named_parameters() if getattr(p, "shared", False)]
    assert marked == ([] if state.pipeline_parallel_rank == 0 else ["lm_head.weight"]), marked
    norm = get_grad_norm([p for _, p in model.local_named_parameters()])
    reference_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in reference.parameters()])
    )
    torch.testing.assert_close(norm, reference_norm, **TOL)
    return count


def two_rank_checks() -> dict[str, int]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    out = {"tied copies synced, norm counts once": _tied_copies_start_equal_and_count_once()}
    for schedule in ("1f1b", "zb_h1", "gpipe"):
        out[f"tied {schedule} x2"] = _accumulated(schedule, calls=2)
    out["tied 1f1b x3"] = _accumulated("1f1b", calls=3)
    # fp32 accumulation hooks: the tied weight's gradient leaves .grad during the backward
    out["tied 1f1b x2 fp32 store"] = _accumulated("1f1b", calls=2, store=True)
    out["tied zb_h1 x2 fp32 store"] = _accumulated("zb_h1", calls=2, store=True)
    return out


def four_rank_checks() -> dict[str, int]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)  # DP = 2
    return {
        "pp2 dp2 tied x2": _accumulated("1f1b", calls=2),
        "pp2 dp2 tied zb_h1 x2": _accumulated("zb_h1", calls=2),
        "pp2 dp2 tied x2 fp32 store": _accumulated("1f1b", calls=2, store=True),
        "pp2 dp2 optimizer wrapper": _accumulated("1f1b", calls=2, use_optimizer_wrapper=True),
        "pp2 dp2 zero1": _accumulated("1f1b", calls=2, use_zero1_optimizer=True),
        "pp2 dp2 wrapper flag set later": _accumulated(
            "1f1b", calls=2, late=True, use_optimizer_wrapper=True
        ),
    }


def test_accumulated_run_train_calls_match_one_process() -> None:
    for rank, result in enumerate(run_distributed(two_rank_checks, 2)):
        assert all(n > 0 for n in result.values()), (rank, result)


def test_accumulation_with_data_parallel_matches_one_process() -> None:
    for rank, result in enumerate(run_distributed(four_rank_checks, 4)):
        assert all(n > 0 for n in result.values()), (rank, result)
