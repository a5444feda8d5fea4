"""EP x PP: pipeline stages holding ``nxd_layers.moe.MoE`` blocks, experts split over EP.

PP2 x DP2 with EP2 inside DP (4 ranks: each stage's two DP ranks form its EP group, each
holding 2 of the 4 experts of every MoE layer; expert-DP groups of one rank). Each DP rank
runs its half of the global batch; the MoE all-to-all runs inside a stage over the EP group,
once per microbatch and direction. Compared with one process on the global batch: the loss,
every MoE block's output, and every gradient (expert weights against their slice of the
full expert tensor), after ``run_train``'s own reduction: dense gradients averaged over DP,
expert gradients summed over expert-DP and divided by DP (the all-to-all backward already
summed the EP group's tokens into them).

Dropless routing runs on the global batch. Capacity routing is decided per forward pass over
the EP group's tokens, so its reference runs the global batch microbatch by microbatch (each
one the DP ranks' microbatches, rank-major), its loss scaled by 1/m as the pipeline's mean.

Tolerance: float64 everywhere; the pipeline computes the same products summed in another
order (per microbatch, all-reduced, padded bmm rows), a few ulps of float64: 1e-10 is far
above that and far below any real mistake (the old plain-mean scale of the expert gradient
is off by a factor 2, a wrong token by ~1e-1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_pipeline import NxDPPModel
from nxd_pipeline._reduce import DataParallelReduction, GradientReducer
from nxd_state import collectives
from nxd_state.testing import run_distributed

TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64, reordered sums only: see the module docstring
VOCAB, HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, SEQ = 32, 16, 4, 2, 8, 4
M = 2  # microbatches
ROWS = 2  # rows per microbatch per DP rank


class MoEBlock(nn.Module):
    """x + MoE(LN(x)): routed gated-SiLU experts, 4 experts, top-2."""

    def __init__(self, capacity_factor: float | None) -> None:
        super().__init__()
        from nxd_layers.moe import ExpertMLPsCapacityFactor, MoE, RouterTopK

        self.ln = nn.LayerNorm(HIDDEN, dtype=torch.float64)
        router = RouterTopK(EXPERTS, TOP_K, HIDDEN, dtype=torch.float64)
        experts = ExpertMLPsCapacityFactor(
            EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", capacity_factor, True,
            dtype=torch.float64,
        )  # fmt: skip
        self.moe = MoE(router, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))[0]


class TinyMoENet(nn.Module):
    """Embedding -> 4 x (MoE block, dense linear) -> head; mean next-token cross entropy."""

    def __init__(self, capacity_factor: float | None) -> None:
        super().__init__()
        torch.manual_seed(0)  # experts drawn full and sliced: any EP degree builds this model
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.h = nn.ModuleList(MoEBlock(capacity_factor) for _ in range(4))
        self.mix = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64) for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block, mix in zip(self.h, self.mix):
            x = x + torch.tanh(mix(block(x)))
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def _record_blocks(model: nn.Module, prefix: str = "") -> dict[str, list[torch.Tensor]]:
    """Every MoEBlock's outputs, call by call, under its name."""
    seen: dict[str, list[torch.Tensor]] = {}
    modules = (
        model.local_named_modules() if isinstance(model, NxDPPModel) else model.named_modules()
    )
    for name, module in modules:
        if isinstance(module, MoEBlock):
            seen[name] = []
            module.register_forward_hook(
                lambda _m, _i, out, calls=seen[name]: calls.append(out.detach().clone())
            )
    return seen


def _reference(
    capacity_factor: float | None, batch: torch.Tensor, dp: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], nn.Module]:
    """One process on the global batch: loss, block outputs (global rows), gradients."""
    reference = TinyMoENet(capacity_factor)
    seen = _record_blocks(reference)
    if capacity_factor is None:
        loss = reference(batch, batch)
        loss.backward()
        outputs = {n: calls[0] for n, calls in seen.items()}
    else:  # capacity per forward: microbatch i is the DP ranks' microbatches i, rank-major
        shards = [s.chunk(M) for s in batch.chunk(dp)]
        micro = [torch.cat([shards[r][i] for r in range(dp)]) for i in range(M)]
        losses = [reference(mb, mb) for mb in micro]
        loss = torch.stack(losses).mean()
        loss.backward()
        outputs = {}
        for name, calls in seen.items():  # back to global row order
            per_rank = [torch.cat([c.chunk(dp)[r] for c in calls]) for r in range(dp)]
            outputs[name] = torch.cat(per_rank)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    return loss.detach(), outputs, grads, reference


def pipeline_expert_parity(
    schedule: str, capacity_factor: float | None, virtual: int = 1
) -> dict[str, Any]:
    """Runs on 4 ranks (PP2 x DP2, EP2); asserts parity, returns what was compared.
    ``virtual`` = 2: interleaved, four one-block chunks (two per rank)."""
    generator = torch.Generator().manual_seed(5)
    dp = 2
    batch = torch.randint(0, VOCAB, (dp * M * ROWS, SEQ), generator=generator)
    loss_ref, outputs_ref, grads_ref, reference = _reference(capacity_factor, batch, dp)

    nxd_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, expert_model_parallel_size=2
    )
    state = nxd_state.get_parallel_state()
    assert (state.data_parallel_size, state.expert_data_parallel_size) == (dp, 1)
    rank, ep_rank = state.data_parallel_rank, state.expert_model_parallel_rank
    model = NxDPPModel(
        TinyMoENet(capacity_factor),
        transformer_layer_cls=MoEBlock,
        num_microbatches=M,
        pipeline_cuts=["mix.1"] if virtual == 1 else ["mix.0", "mix.1", "mix.2"],
        virtual_pipeline_size=virtual,
        schedule=schedule,
    )
    seen = _record_blocks(model)
    mine = batch.chunk(dp)[rank]
    loss = model.run_train(input_ids=mine, labels=mine)
    if state.is_pipeline_last_stage:  # this DP rank's mean; the global one over DP, in float64
        assert isinstance(loss, torch.Tensor)
        total = collectives.all_reduce(loss.clone(), group=state.data_parallel_group)
        torch.testing.assert_close(total / dp, loss_ref, **TOL)
    else:
        assert loss is None

    rows = slice(rank * M * ROWS, (rank + 1) * M * ROWS)
    for name, calls in seen.items():  # microbatches in order under every schedule
        torch.testing.assert_close(torch.cat(calls), outputs_ref[name][rows], **TOL, msg=name)
    local = EXPERTS // state.expert_model_parallel_size
    experts = []
    for name, param in model.local_named_parameters():
        expected = grads_ref[name]
        if getattr(param, "expert_model_parallel", False):
            expected = expected[ep_rank * local : (ep_rank + 1) * local]
            experts.append(name)
            # the values too: this rank's slice of the full expert tensor
            full = dict(reference.named_parameters())[name]
            slice_ = full[ep_rank * local : (ep_rank + 1) * local]
            torch.testing.assert_close(param.detach(), slice_.detach(), rtol=0, atol=0)
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, expected, **TOL, msg=name)
    nxd_state.destroy_model_parallel()
    return {"blocks": sorted(seen), "experts": experts}


def test_pipeline_with_expert_parallel_matches_one_process() -> None:
    """PP2 x DP2 x EP2, dropless, 1F1B: loss, block outputs, every gradient."""
    results = run_distributed(pipeline_expert_parity, 4, "1f1b", None)
    for pp_rank, blocks in ((0, ["h.0", "h.1"]), (1, ["h.2", "h.3"])):
        for dp_rank in range(2):
            result = results[pp_rank * 2 + dp_rank]  # ranks are [PP, DP] row-major
            assert result["blocks"] == blocks, result
            assert len(result["experts"]) == 4, result  # gate_up and down of two blocks


def expert_schedules() -> int:
    """The other schedules (ZB-H1's split backward; GPipe; interleaved, v = 2) and capacity
    routing."""
    count = 0
    for schedule, capacity in (("zb_h1", None), ("gpipe", None), ("1f1b", 1.0)):
        count += len(pipeline_expert_parity(schedule, capacity)["experts"])
    count += len(pipeline_expert_parity("interleaved_1f1b", None, virtual=2)["experts"])
    return count


def test_expert_parallel_under_other_schedules_and_capacity() -> None:
    assert run_distributed(expert_schedules, 4) == [16] * 4  # 4 expert weights per run


def reduce_markers() -> tuple[list[float], list[float]]:
    """DP4 with EP2 (expert-DP groups [0, 2] and [1, 3]): the reducer alone, on marker
    gradients equal to the rank: dense -> mean over DP, expert -> Σ over expert-DP / DP."""
    nxd_state.initialize_model_parallel(expert_model_parallel_size=2)
    state = nxd_state.get_parallel_state()
    dense, expert = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 3))
    expert.expert_model_parallel = True  # type: ignore[attr-defined]  # as nxd_layers.moe sets it
    params = {"dense": dense, "expert": expert}
    reducer = GradientReducer(
        params=params, tied=[], pipeline_group=state.pipeline_parallel_group, device=dense.device
    )
    assert state.data_context_parallel_group is not None
    reducer.configure(
        params,
        DataParallelReduction(
            group=state.data_context_parallel_group,
            size=4,
            expert_group=state.expert_data_parallel_group,
        ),
    )
    reducer.begin()
    marker = float(torch.distributed.get_rank())
    (dense.sum() * marker + expert.sum() * marker).backward()
    reducer.finish()
    assert dense.grad is not None
    assert expert.grad is not None
    nxd_state.destroy_model_parallel()
    return dense.grad.tolist(), expert.grad.flatten().tolist()


def test_expert_gradients_sum_over_expert_dp_and_divide_by_dp() -> None:
    """The scale NxDOptimizer uses: a mean over expert-DP (EP times too large) or over DP
    (mixing different experts) fails here."""
    for rank, (dense, expert) in enumerate(run_distributed(reduce_markers, 4)):
        expert_dp = [0, 2] if rank % 2 == 0 else [1, 3]
        assert dense == [1.5] * 3  # (0 + 1 + 2 + 3) / 4
        assert expert == [sum(expert_dp) / 4] * 6, (rank, expert)
