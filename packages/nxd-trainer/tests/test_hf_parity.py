"""Unmodified Hugging Face models parallelised by ``nxd_trainer.hf`` compute what the unsharded
model computes: Llama, Mistral, Qwen2 (tied embeddings, Q/K/V biases) and Qwen3 (Q/K norms),
at TP=2 and TP=4 (KV heads < TP: Mistral's 1 KV head at TP=2 and every family at TP=4 go
through the GQA projection with replicated KV heads), with and without sequence parallelism,
and with a vocabulary TP does not divide (padded).

For each: logits (gathered over the vocabulary shards), loss and the gradient of every
parameter (gathered, GQA replicas and vocabulary padding undone) equal the unsharded model's
on the same batch. Tolerance: fp32, rtol 1e-5 / atol 1e-6 for logits and loss, atol 1e-6 +
rtol 1e-4 for gradients: TP splits each matmul's sum over ranks and adds the partial sums in
another order (round-off ~1e-7 relative on O(1) values); gradients of small entries pass
through more such sums. A wrong head split, a missing replica sum or a gradient not summed
over TP is off by O(1) relative.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
OUT_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}


def _reference(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def _parallel(model: torch.nn.Module, ids: torch.Tensor, sp: bool) -> dict[str, Any]:
    from nxd_layers import allreduce_sequence_parallel_gradients
    from nxd_trainer.hf import ParallelizersManager

    cfg = model.config
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, sequence_parallel_enabled=sp)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    allreduce_sequence_parallel_gradients(list(model.parameters()))
    grads = {}
    for name, param in model.named_parameters():
        grads[parallelizer.hf_name(name)] = H.full(param, param.grad, name, cfg)
    return {
        "logits": H.full_logits(out.logits.detach(), cfg.vocab_size),
        "loss": out.loss.detach(),
        "grads": grads,
        "gqa": any("qkv_proj" in n for n, _ in model.named_parameters()),
    }


def _compare(case: str, got: dict[str, Any], want: dict[str, Any]) -> None:
    torch.testing.assert_close(got["loss"], want["loss"], **OUT_TOL, msg=f"{case}: loss")
    torch.testing.assert_close(got["logits"], want["logits"], **OUT_TOL, msg=f"{case}: logits")
    assert got["grads"].keys() == want["grads"].keys(), (
        case,
        sorted(got["grads"].keys() ^ want["grads"].keys()),
    )
    for name, grad in got["grads"].items():
        torch.testing.assert_close(
            grad, want["grads"][name], **GRAD_TOL, msg=lambda m, n=name: f"{case} {n}: {m}"
        )


def families_at(tp: int, cases: list[tuple[str, bool, int]]) -> list[str]:
    """Every (family, SP, vocab) case on this rank; returns the cases that used GQA."""
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    gqa = []
    for family, sp, vocab in cases:
        case = f"{family} tp={tp} sp={sp} vocab={vocab}"
        reference = H.model(family, vocab=vocab)
        parallel = copy.deepcopy(reference)
        ids = H.batch(vocab=vocab)
        want = _reference(reference, ids)
        got = _parallel(parallel, ids, sp)
        _compare(case, got, want)
        if got["gqa"]:
            gqa.append(case)
    return gqa


def test_every_family_at_tp2_with_and_without_sp() -> None:
    cases = [(f, False, H.VOCAB) for f in H.FAMILIES] + [(f, True, H.VOCAB) for f in H.FAMILIES]
    cases.append(("llama", True, H.VOCAB + 1))  # 97 rows: padded to 98
    gqa = run_distributed(families_at, 2, 2, cases)[0]
    assert gqa == ["mistral tp=2 sp=False vocab=96", "mistral tp=2 sp=True vocab=96"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_every_family_at_tp4_kv_heads_below_tp(sp: bool) -> None:
    cases = [(f, sp, H.VOCAB) for f in H.FAMILIES]
    gqa = run_distributed(families_at, 4, 4, cases)[0]
    assert len(gqa) == len(H.FAMILIES)  # 1 or 2 KV heads on 4 ranks: replicated
