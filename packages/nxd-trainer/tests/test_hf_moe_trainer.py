"""The trainer API at ``expert_parallel_size=2``: ``initialize_parallel_model`` parallelises a
stock Hugging Face MoE model (experts sharded over EP), ``initialize_parallel_optimizer``'s
NxDOptimizer (AdamW, clipping at 0.5; with ZeRO-1, nxd-optim's ``NeuronEPZero1Optimizer``)
trains it, and two steps follow the one-process
run: each step the reference runs every DP rank's batch through the unsharded model and steps
on the gradient of their mean loss (what averaging over DP computes), clipped by the norm of
the whole model (each expert counted once). Losses (router auxiliary loss included) and every
parameter after the steps, the experts as the slice each rank holds, must match (checkpoints
at EP > 1: ``test_hf_moe_checkpoint``).

Tolerance rtol 1e-4 / atol 1e-5 (``test_hf_trainer``'s): fp32 sums in another order (DP
average, expert partial sums), amplified by AdamW's division by the root of the second moment.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

M = load_sibling(__file__, "_moe")
TOL = {"rtol": 1e-4, "atol": 1e-5}
ADAMW = {"lr": 1e-2, "eps": 1e-4}
MAX_NORM, STEPS = 0.5, 2


def _reference(family: str, dp: int) -> dict[str, Any]:
    model = M.moe_model(family).train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        outs = [model(input_ids=b, labels=b).loss for b in M.batches(dp, seed=30 + step)]
        (sum(outs) / dp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append([float(loss.detach()) for loss in outs])
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _trained(family: str, tp: int, ep: int, zero1: bool = False) -> dict[str, Any]:
    import nxd_state
    import nxd_trainer as nxd

    nxd_state.destroy_model_parallel()
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        expert_parallel_size=ep,
        optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": MAX_NORM},
    )
    state = nxd_state.get_parallel_state()
    model = nxd.initialize_parallel_model(nxd_config, lambda: M.moe_model(family))
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), **ADAMW
    )
    dp, dp_rank = state.data_parallel_size, state.data_parallel_rank
    losses = []
    for step in range(STEPS):
        ids = M.batches(dp, seed=30 + step)[dp_rank]
        losses.append(float(model.run_train(input_ids=ids, labels=ids)))
        optimizer.step()
        optimizer.zero_grad()
    want = _reference(family, dp)
    case = f"{family} tp={tp} ep={ep} rank={state.rank}"
    for step, loss in enumerate(losses):
        assert loss == pytest.approx(want["losses"][step][dp_rank], rel=1e-4, abs=1e-5), case
    local = M.EXPERTS // ep
    first = state.expert_model_parallel_rank * local
    config = model.config
    for name, param in model.named_parameters():
        value = M.R.H.full(param, param.detach(), name, config)
        ref = want["params"][name]
        if M.is_expert(param):
            ref = ref[first : first + local]
        torch.testing.assert_close(value, ref, **TOL, msg=lambda m, n=name: f"{case} {n}: {m}")
    return {"losses": losses}


def test_trainer_at_ep2_follows_one_process() -> None:
    """Qwen2-MoE (shared expert with its sigmoid gate, router auxiliary loss) at EP2 = DP2."""
    ranks = run_distributed(_trained, 2, "qwen2_moe", 1, 2)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each DP rank trained on its own batch


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_trainer_at_tp2_ep2_follows_one_process(family: str) -> None:
    """TP2 x EP2 on 4 ranks: attention heads and each expert's features over TP, experts
    over EP (the gradient norm sums TP shards and counts each expert once)."""
    ranks = run_distributed(_trained, 4, family, 2, 2)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # TP ranks of one DP rank
    assert ranks[0]["losses"] != ranks[2]["losses"]


def _zero1_optimizer_class(family: str) -> str:
    """What ZeRO-1 at EP2 builds, after following one process (``_trained``'s checks)."""
    import nxd_trainer as nxd

    _trained(family, 1, 2, zero1=True)
    config = nxd.neuronx_distributed_config(
        expert_parallel_size=2, optimizer_config={"zero_one_enabled": True}
    )
    model = nxd.initialize_parallel_model(config, lambda: M.moe_model(family))
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.AdamW, model.parameters(), **ADAMW
    )
    return type(optimizer.optimizer).__name__


def test_trainer_zero1_at_ep2_dp4_follows_one_process() -> None:
    """ZeRO-1 at EP2 x DP4 (expert-DP 2): expert state sharded over expert-DP, the rest over
    DP, one norm; the same steps as one process."""
    assert run_distributed(_zero1_optimizer_class, 4, "mixtral") == ["NeuronEPZero1Optimizer"] * 4
