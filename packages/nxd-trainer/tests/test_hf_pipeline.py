"""A parallelised Hugging Face model trained at TP=2 x PP=2 (4 ranks) follows the one-process
run: 3 AdamW steps of every family (tied embeddings across the first and last stage for
Qwen2, replicated KV heads for Mistral), through ``Parallelizer.parallelize`` with
``pipeline_parallel_input_names`` (``NxDPPModel``, ``tracer_cls="hf"``, 2 micro-batches).

Every step's loss and, after the last, every parameter (gathered over TP, each held by the
rank of its stage) equal the unsharded model's. Tolerance rtol 1e-4 / atol 1e-5: fp32
re-association (TP splits the matmul sums, the pipeline averages two micro-batch means
instead of one mean) amplified by AdamW's normalised steps (see ``_recipe.TOL``); a gradient
missing its TP reduction or a tied gradient not summed across stages is off by ~lr.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
TOL = {"rtol": 1e-4, "atol": 1e-5}
STEPS = 3
ADAMW = {"lr": 1e-2, "eps": 1e-4}  # eps: see _recipe.ADAMW


def _train_reference(model: torch.nn.Module) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        ids = H.batch(seed=10 + step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def train_pipelined(families: list[str], sp: bool, checkpointing: bool) -> dict[str, Any]:
    import nxd_state
    from nxd_layers import allreduce_sequence_parallel_gradients
    from nxd_trainer.activation_checkpoint import is_checkpointed
    from nxd_trainer.hf import ParallelizersManager

    nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    out = {}
    for family in families:
        reference = H.model(family)
        cfg = reference.config
        parallelizer = ParallelizersManager.parallelizer_for_model(reference)
        model = parallelizer.parallelize(
            copy.deepcopy(reference),
            pipeline_parallel_input_names=["input_ids", "labels"],
            pipeline_parallel_num_microbatches=2,
            sequence_parallel_enabled=sp,
            pipeline_parallel_gradient_checkpointing_enabled=checkpointing,
        )
        recomputed = [n for n, m in model.local_named_modules() if is_checkpointed(m)]
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        losses = []
        for step in range(STEPS):
            ids = H.batch(seed=10 + step)
            loss = model.run_train(input_ids=ids, labels=ids)
            allreduce_sequence_parallel_gradients(list(model.parameters()))  # NxDOptimizer's
            optimizer.step()
            optimizer.zero_grad()
            losses.append(None if loss is None else float(loss))
        params = {}
        for name, param in model.local_named_parameters():
            hf_name = parallelizer.hf_name(name)
            if cfg.tie_word_embeddings and hf_name == "lm_head.weight":  # the last stage's copy
                hf_name = "model.embed_tokens.weight"
            params.setdefault(hf_name, []).append(H.full(param, param.detach(), name, cfg))
        out[family] = {
            "losses": losses,
            "params": params,
            "recomputed": recomputed,
            "expected": _train_reference(reference),
        }
    return out


@pytest.mark.parametrize(
    ("families", "sp", "checkpointing"),
    [
        pytest.param(["llama", "qwen2"], False, False, id="llama-qwen2"),
        pytest.param(["qwen2"], True, True, id="qwen2-sp-checkpointing"),
        pytest.param(
            ["mistral", "qwen3"], False, False, id="mistral-qwen3", marks=pytest.mark.slow
        ),
        pytest.param(["llama", "mistral", "qwen3"], True, False, id="sp", marks=pytest.mark.slow),
        pytest.param(["llama"], False, True, id="checkpointing", marks=pytest.mark.slow),
    ],
)
def test_trains_at_tp2_pp2_like_one_process(
    families: list[str], sp: bool, checkpointing: bool
) -> None:
    """Llama, and Qwen2 with its embedding tied to the head across the first and last
    stage; Mistral (KV heads replicated) and Qwen3 (Q/K norms) under ``-m slow``. With
    sequence parallelism (``sp``): the activations sent between stages are this rank's
    slice of the sequence; the first stage's graph splits it, the last stage's head gathers
    it. ``checkpointing``: every local decoder layer recomputed in backward
    (``pipeline_parallel_gradient_checkpointing_enabled``)."""
    if not H.pipeline_capture_works():  # see _hf.PIPELINE_FIRST_GOOD_TRANSFORMERS
        from nxd_pipeline import PipelineTraceError

        with pytest.raises(PipelineTraceError, match=r"tensor constant .* on the meta device"):
            run_distributed(train_pipelined, 4, families, sp, checkpointing)
        return
    results = run_distributed(train_pipelined, 4, families, sp, checkpointing)
    for family in families:
        expected = results[0][family]["expected"]
        covered = set()
        for rank, result in enumerate(results):
            got = result[family]
            if got["losses"][0] is not None:  # the last stage's ranks
                torch.testing.assert_close(
                    torch.tensor(got["losses"]), torch.tensor(expected["losses"]), **TOL
                )
            for name, values in got["params"].items():
                for value in values:
                    torch.testing.assert_close(
                        value,
                        expected["params"][name],
                        **TOL,
                        msg=lambda m, n=name, r=rank, f=family: f"{f} rank {r} {n}: {m}",
                    )
                covered.add(name)
        assert covered == set(expected["params"]), (family, set(expected["params"]) - covered)
        assert any(r[family]["losses"][0] is not None for r in results)
        for result in results:  # each rank's one decoder layer (2 layers, 2 stages)
            assert len(result[family]["recomputed"]) == (1 if checkpointing else 0), result
