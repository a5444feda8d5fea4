"""Mixtral, Qwen2-MoE (shared expert, sigmoid gate, ``norm_topk_prob=False``) and Qwen3-MoE
(``norm_topk_prob=True``), stock transformers classes from tiny configs, parallelised with
expert parallelism by ``nxd_trainer.hf``: EP2 (DP2) and TP2 x EP2 (4 ranks).

Each DP rank ``d`` runs its own batch ``b_d``; the reference runs every ``b_j`` through the
unsharded model in one process. Per rank: logits (gathered over the vocabulary), loss and
the router's auxiliary loss (``output_router_logits=True``, added to the loss as transformers
does) equal the reference's on ``b_d``. Gradients after ``loss.backward()``: each rank's
gradient is of its own loss, except an expert's, which the all-to-all's backward sums over the
EP group's tokens; summed over DP (non-expert) and over the expert-DP group (expert), and
gathered over TP, they equal the gradient of ``sum_j L(b_j)`` in one process, the experts
compared with the slice (``E/EP`` experts) this rank holds. The weights each rank holds are
checked against that slice too.

Tolerance: fp32. Logits, losses: rtol 1e-5 / atol 1e-5 (TP splits each row-parallel matmul
and each expert's down projection into partial sums added in another order: ~1e-7 relative
per sum, which through two layers, the shared expert's sigmoid gate and the head reaches
~3e-6 absolute on logits near zero; atol 1e-6 failed on 2 of 1536 Qwen2-MoE logits by that);
gradients: rtol 1e-4 / atol 1e-6 (small entries pass through more such sums, and the DP sum
adds the per-batch gradients in another order). Routing is the family's own router on the
same values, so it is the same choice on both sides; a wrong expert slice, a token sent to the
wrong rank or a gradient not summed over EP or TP is off by O(1) relative.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

M = load_sibling(__file__, "_moe")
R = M.R
OUT_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
MOE_FAMILIES = M.MOE_FAMILIES
moe_model, batches = M.moe_model, M.batches


def _ep_parity(families: tuple[str, ...], tp: int, ep: int) -> list[str]:
    import nxd_state
    from nxd_state import collectives
    from nxd_trainer.hf import ParallelizersManager

    nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep
    )
    state = nxd_state.get_parallel_state()
    dp, dp_rank = state.data_parallel_size, state.data_parallel_rank
    local_experts = M.EXPERTS // ep
    first = state.expert_model_parallel_rank * local_experts
    checked = []
    for family in families:
        reference = moe_model(family)
        parallel = copy.deepcopy(reference)
        ids = batches(dp)
        outs = [reference(input_ids=b, labels=b) for b in ids]
        sum(o.loss for o in outs).backward()
        want = outs[dp_rank]
        ref_params = dict(reference.named_parameters())

        parallelizer = ParallelizersManager.parallelizer_for_model(parallel)
        parallel = parallelizer.parallelize(parallel, device=torch.device("cpu"))
        assert any(M.is_expert(p) for p in parallel.parameters()), "no expert was sharded"
        out = parallel(input_ids=ids[dp_rank], labels=ids[dp_rank])
        out.loss.backward()
        case = f"{family} tp={tp} ep={ep} rank={state.rank}"
        logits = R.H.full_logits(out.logits.detach(), R.VOCAB) if tp > 1 else out.logits
        torch.testing.assert_close(out.loss, want.loss, **OUT_TOL, msg=f"{case}: loss")
        torch.testing.assert_close(out.aux_loss, want.aux_loss, **OUT_TOL, msg=f"{case}: aux")
        torch.testing.assert_close(logits, want.logits, **OUT_TOL, msg=f"{case}: logits")

        names = set()
        for name, param in parallel.named_parameters():
            grad = param.grad.clone()
            if M.is_expert(param):
                collectives.all_reduce(grad, state.expert_data_parallel_group)
            else:
                collectives.all_reduce(grad, state.data_parallel_group)
            value = R.H.full(param, param.detach(), name, reference.config)
            grad = R.H.full(param, grad, name, reference.config)
            ref, ref_grad = ref_params[name].detach(), ref_params[name].grad
            if M.is_expert(param):  # this rank's experts: a slice along dim 0
                assert param.shape[0] == local_experts, (name, param.shape)
                ref, ref_grad = (
                    ref[first : first + local_experts],
                    ref_grad[first : first + local_experts],
                )
            torch.testing.assert_close(value, ref, rtol=0, atol=0, msg=f"{case} {name}: value")
            torch.testing.assert_close(
                grad, ref_grad, **GRAD_TOL, msg=lambda m, c=case, n=name: f"{c} {n} grad: {m}"
            )
            names.add(name)
        assert names == set(ref_params), sorted(names ^ set(ref_params))
        checked.append(case)
    return checked


def test_moe_families_at_ep2() -> None:
    """EP2 = DP2 on 2 ranks: each holds 2 of the 4 experts of every MoE layer (checkpoints:
    ``test_hf_moe_checkpoint``)."""
    ranks = run_distributed(_ep_parity, 2, MOE_FAMILIES, 1, 2)
    assert all(len(r) == len(MOE_FAMILIES) for r in ranks)


def test_moe_families_at_tp2_ep2() -> None:
    """TP2 x EP2 on 4 ranks: attention split by heads, each expert's features split over TP,
    the experts over EP."""
    ranks = run_distributed(_ep_parity, 4, MOE_FAMILIES, 2, 2)
    assert all(len(r) == len(MOE_FAMILIES) for r in ranks)


@pytest.mark.slow
def test_moe_families_at_dp4_ep2() -> None:
    """EP2 inside DP4 (4 ranks): two EP groups, expert gradients summed over the expert-DP
    group of 2 ranks holding the same experts."""
    ranks = run_distributed(_ep_parity, 4, MOE_FAMILIES, 1, 2)
    assert all(len(r) == len(MOE_FAMILIES) for r in ranks)


def _refusal(family: str, ep: int) -> str:
    import nxd_state
    from nxd_trainer.hf import ParallelizersManager

    nxd_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model: Any = R.build(family) if family != "llama" else R.H.model("llama")
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    try:
        parallelizer.parallelize(model, device=torch.device("cpu"))
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return "not refused"


def test_dense_family_at_ep2_is_refused() -> None:
    """EP > 1 on a model without experts is refused naming the family (not silently DP)."""
    ranks = run_distributed(_refusal, 2, "llama", 2)
    for message in ranks:
        assert "no mixture-of-experts layers" in message, message
        assert "'llama'" in message, message


def test_expert_count_not_divisible() -> None:
    """An expert count EP does not divide is refused naming both values (the check itself,
    without the 3 ranks EP=3 would need)."""
    from nxd_trainer.hf._experts import check_experts

    model = R.build("qwen3_moe")
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by .*size=3"):
        check_experts(model, "qwen3_moe", 3, 1)
    with pytest.raises(ValueError, match=r"intermediate size 16 is not divisible by .*size=3"):
        check_experts(model, "qwen3_moe", 2, 3)
