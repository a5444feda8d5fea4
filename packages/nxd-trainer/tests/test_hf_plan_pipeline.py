"""Families parallelised by transformers' declared plans, cut into pipeline stages: at TP=2 x
PP=2 (4 ranks) one training step's loss and every parameter's gradient equal the unsharded
model's.

The stages are cut from the decoder stack that the family's ``base_model_pp_plan`` names
(``gpt_neox.layers`` for GPT-NeoX, ``model.layers`` elsewhere); each decoder layer runs its
own forward, sharded by the family's tensor-parallel plan. Default: Gemma 2 (embedding
scale, logit soft-capping, alternating sliding-window layers, embeddings tied across the
first and last stage) and GPT-NeoX (another base-model prefix, parallel attention and MLP,
partial rotary, biases). ``-m slow``: OLMo 2 (Q/K norms over all heads), Phi-3 (fused QKV),
Cohere, Starcoder2 and Mixtral (experts replicated over TP).

Tolerance: ``_registry.OUT_TOL`` for the loss and ``GRAD_TOL`` for gradients: fp32
re-association (TP splits the matmul sums; the pipeline averages two micro-batch means) on
weights drawn at unit scale; a gradient missing its TP reduction, or a tied embedding's
gradient not summed across stages, is off by far more.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_registry")
H = load_sibling(__file__, "_hf")


def step_pipelined(families: list[str], sp: bool) -> dict[str, Any]:
    import warnings

    import transformers

    import nxd_state
    from nxd_layers import allreduce_sequence_parallel_gradients
    from nxd_trainer.hf import ParallelizersManager

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    out: dict[str, Any] = {}
    for family in families:
        reference = R.build(family)
        cfg = reference.config
        embedding = reference.get_input_embeddings().weight
        tied_name = next(n for n, p in reference.named_parameters() if p is embedding)
        parallelizer = ParallelizersManager.parallelizer_for_model(reference)
        model = copy.deepcopy(reference)
        ids = torch.randint(
            0, R.VOCAB, (2 * R.BATCH, R.SEQ), generator=torch.Generator().manual_seed(3)
        )
        expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
        expected.backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        model = parallelizer.parallelize(
            model,
            pipeline_parallel_input_names=["input_ids", "labels"],
            pipeline_parallel_num_microbatches=2,
            sequence_parallel_enabled=sp,
        )
        loss = model.run_train(input_ids=ids, labels=ids)
        allreduce_sequence_parallel_gradients(list(model.parameters()))  # NxDOptimizer's
        grads = {}
        for name, param in model.local_named_parameters():
            hf_name = parallelizer.hf_name(name)
            if cfg.tie_word_embeddings and hf_name == "lm_head.weight":  # the last stage's copy
                hf_name = tied_name
            assert param.grad is not None, f"{family} {name}: no gradient"
            grads[hf_name] = H.full(param, param.grad, name, cfg)
        out[family] = {
            "loss": None if loss is None else float(loss),
            "expected_loss": float(expected),
            "grads": grads,
            "expected_grads": ref_grads,
        }
    return out


def _check(families: list[str], sp: bool) -> None:
    import transformers

    from nxd_trainer.hf.plan import pipeline_layers

    for family in families:
        if family not in R.families() or pipeline_layers(family) is None:
            pytest.skip(
                f"transformers {transformers.__version__} has no {family} with a pipeline plan "
                f"(base_model_pp_plan)"
            )
    results = run_distributed(step_pipelined, 4, families, sp)
    for family in families:
        expected = results[0][family]
        covered: set[str] = set()
        losses = [r[family]["loss"] for r in results if r[family]["loss"] is not None]
        assert losses, f"{family}: no rank of the last stage returned the loss"
        for loss in losses:
            torch.testing.assert_close(
                torch.tensor(loss), torch.tensor(expected["expected_loss"]), **R.OUT_TOL
            )
        for rank, result in enumerate(results):
            for name, grad in result[family]["grads"].items():
                torch.testing.assert_close(
                    grad,
                    expected["expected_grads"][name],
                    **R.GRAD_TOL,
                    msg=lambda m, n=name, r=rank, f=family: f"{f} rank {r} {n}: {m}",
                )
                covered.add(name)
        missing = set(expected["expected_grads"]) - covered
        assert not missing, f"{family}: gradients no stage holds: {sorted(missing)}"


@pytest.mark.parametrize(
    ("families", "sp"),
    [
        pytest.param(["gemma2", "gpt_neox"], False, id="gemma2-gpt_neox"),
        pytest.param(
            ["olmo2", "phi3", "cohere", "starcoder2", "mixtral"],
            False,
            id="olmo2-phi3-cohere-starcoder2-mixtral",
            marks=pytest.mark.slow,
        ),
        pytest.param(["gemma2", "gpt_neox", "phi3"], True, id="sp", marks=pytest.mark.slow),
    ],
)
def test_plan_family_step_at_tp2_pp2_equals_one_process(families: list[str], sp: bool) -> None:
    """``sp``: with sequence parallelism (each rank's slice of the sequence between stages;
    the family's blocks gather it, their row-parallel outputs scatter it back)."""
    if not H.pipeline_capture_works():
        pytest.skip(
            f"pipeline capture on meta needs transformers >= {H.PIPELINE_FIRST_GOOD_TRANSFORMERS} "
            f"(test_hf_pipeline asserts the clear error below it)"
        )
    _check(families, sp)


def test_a_family_whose_stages_specialise_is_refused_by_name() -> None:
    """DeepSeek-V4's captured stages specialise on the sequence length (found by the sweep of
    every family with a pipeline plan at PP=2): refused by name (``plan.PIPELINE_REFUSED``),
    before any change."""
    from torch import nn

    from nxd_trainer.hf import ParallelizersManager, UnsupportedModelError

    if "deepseek_v4" not in R.families():
        pytest.skip("this transformers has no deepseek_v4")
    parallelizer = ParallelizersManager.parallelizer_for_model("deepseek_v4")
    with pytest.raises(UnsupportedModelError, match="specialise on the sequence length"):
        parallelizer._check_pipeline(nn.Module(), ["input_ids", "labels"])


def test_router_aux_loss_at_pp_is_refused() -> None:
    """Mixtral with ``output_router_logits=True``: its auxiliary loss sums the router logits of
    every layer, which no single stage holds; refused rather than computed from one stage."""
    from nxd_trainer.hf import ParallelizersManager, UnsupportedModelError
    from nxd_trainer.hf.plan import pipeline_layers

    if "mixtral" not in R.families() or pipeline_layers("mixtral") is None:
        pytest.skip("this transformers has no mixtral with a pipeline plan")
    model = R.build("mixtral")
    model.config.output_router_logits = True
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    with pytest.raises(UnsupportedModelError, match="output_router_logits=True at PP > 1"):
        parallelizer._check_pipeline(model, ["input_ids", "labels"])
