"""No family in transformers' registry is silently wrong: every causal-LM family transformers
ships (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` of the installed version) is either parallelised
at TP=2, and again at TP=2 with sequence parallelism, with logits, loss and gradients equal to
the unsharded model's, or refused with
:class:`nxd_trainer.hf.UnsupportedModelError` naming it (by its config: no tensor-parallel
plan, multimodal; or by inspecting the built model). Families that do not build from their
default config made tiny are listed with the reason (``skipped``).

One pool of 2 ranks runs every family that is not refused by config (tiny configs: 2 layers,
hidden 32, vocabulary 96, 8 tokens). Tolerances: ``_registry.OUT_TOL`` / ``GRAD_TOL``.
With ``NXD_HF_COVERAGE_JSON=path`` the outcomes are written there
(``scripts/hf_coverage_table.py`` makes the README's table from them).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_registry")

LOCK_TRANSFORMERS = "5.23"
"""The version the lock pins: the coverage below is what it gives. Older versions (the
``lowest`` / ``middle`` sessions) declare other plans (other styles, fewer families), so
there only the no-silent-mismatch guarantee is asserted."""

PARITY_AT_LOCK = (
    "cohere",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt_neox",
    "granite",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "starcoder2",
)
"""Families the issue asked for (MoE ones with experts replicated over TP)."""


def _skip_if_missing(family: str) -> None:
    import transformers

    if family not in R.families():
        pytest.skip(f"{family} is not in transformers {transformers.__version__}'s registry")


def _outcomes() -> dict[str, tuple[str, ...]]:
    """Family -> (TP outcome, detail, SP outcome, detail); see ``_registry``."""
    outcomes: dict[str, tuple[str, ...]] = {}
    to_build = []
    for model_type in R.families():
        message = R.refused_by_config(model_type)
        if message is None:
            to_build.append(model_type)
        else:
            outcomes[model_type] = ("refused", message, "n/a", "")
    ranks = run_distributed(R.check_families, 2, to_build, timeout=900)
    for model_type in to_build:
        per_rank = [r[model_type] for r in ranks]
        agree = per_rank[0][::2] == per_rank[1][::2]
        assert agree, f"{model_type}: ranks disagree {per_rank}"
        outcomes[model_type] = tuple(per_rank[0])
    return outcomes


def test_every_registry_family_has_parity_or_a_clear_refusal() -> None:
    import transformers
    from packaging.version import Version

    outcomes = _outcomes()
    path = os.environ.get("NXD_HF_COVERAGE_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"transformers": transformers.__version__, "families": outcomes}, f, indent=1)
    bad = [
        f"{f} {what}: {o[i]}: {o[i + 1]}"
        for f, o in sorted(outcomes.items())
        for i, what in ((0, "TP=2"), (2, "TP=2 with SP"))
        if o[i] in ("mismatch", "error")
    ]
    assert not bad, "silently wrong or crashing families:\n" + "\n".join(bad)
    assert set(outcomes) == set(R.families())
    unnamed = [
        f
        for f, o in outcomes.items()
        for i in (0, 2)
        if o[i] == "refused" and repr(f) not in o[i + 1]
    ]
    assert not unnamed, f"refusals that do not name the family: {unnamed}"
    if Version(transformers.__version__) >= Version(LOCK_TRANSFORMERS):
        missing = {
            f: outcomes[f] for f in PARITY_AT_LOCK if f in outcomes and outcomes[f][0] != "parity"
        }
        assert not missing, f"expected parity: {missing}"
        assert sum(o[0] == "parity" for o in outcomes.values()) >= len(PARITY_AT_LOCK)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text", "olmo2"])
def test_registered_model_spec_is_exact_or_refused(family: str) -> None:
    """A ``ModelSpec`` registration (the Llama-family path: rebuilt attention forward) of a
    family gives the unsharded model's logits, loss and gradients or is refused naming the
    family. Before the inspection these four gave wrong logits silently (embedding scale,
    soft-capping, Q/K norms dropped by the rebuilt modules)."""
    _skip_if_missing(family)
    ranks = run_distributed(_register_and_check, 2, family)
    assert ranks[0] == ranks[1]
    outcome, detail = ranks[0][:2]
    if outcome == "skipped":  # transformers 5.4's Olmo2Config does not validate its default
        pytest.skip(detail)
    assert outcome in ("parity", "refused"), f"{outcome}: {detail}"
    if outcome == "refused":
        assert family in detail


def _register_and_check(family: str) -> tuple[str, ...]:
    import nxd_state
    from nxd_trainer.hf import ModelSpec, Parallelizer, ParallelizersManager

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    spec = ModelSpec(model_type=family)
    ParallelizersManager.register(type(f"{family}Spec", (Parallelizer,), {"spec": spec}))
    return R.check_family(family)  # a fresh rank process: the registration dies with it


@pytest.mark.parametrize(("family", "vocab"), [("llama", 97), ("gemma2", 96)])
def test_gather_output_gives_full_vocabulary_logits(family: str, vocab: int) -> None:
    """``parallelize(gather_output=True)``: the logits are the whole vocabulary on every rank
    (padding columns dropped: 97 is padded to 98 at TP=2) and equal the unsharded model's,
    as the loss (the family's own, on those logits) does; Llama through the Llama-family
    path, Gemma 2 (soft-capped logits) through its tensor-parallel plan."""
    _skip_if_missing(family)
    ranks = run_distributed(_gathered, 2, family, vocab)
    for logits, loss, ref_logits, ref_loss in ranks:
        assert logits.shape == ref_logits.shape == (R.BATCH, R.SEQ, vocab)
        torch.testing.assert_close(logits, ref_logits, **R.OUT_TOL)
        torch.testing.assert_close(loss, ref_loss, **R.OUT_TOL)


def _gathered(family: str, vocab: int) -> tuple[torch.Tensor, ...]:
    import nxd_state
    from nxd_trainer.hf import ParallelizersManager

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = R.H.model("llama", vocab=vocab).eval() if family == "llama" else R.build(family)
    ids = torch.randint(0, vocab, (R.BATCH, R.SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids)
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
        parallel = parallelizer.parallelize(model, device=torch.device("cpu"), gather_output=True)
        out = parallel(input_ids=ids, labels=ids)
    return out.logits, out.loss, ref.logits, ref.loss


EXPORT_FAMILIES = ("gemma3_text", "phi3", "mixtral")
"""Plan families through the sharded checkpoint and ``export_hf``: a scaled embedding and
per-head Q/K norms (Gemma 3), fused QKV and gate/up gathered (Phi-3), replicated experts."""


def _trained_and_saved(root: str, families: tuple[str, ...]) -> dict[str, torch.Tensor]:
    import nxd_state
    from nxd_state import collectives
    from nxd_trainer.hf import ParallelizersManager, export_hf

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    ids = torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ), generator=torch.Generator().manual_seed(4))
    for family in families:
        model = R.build(family)
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model, device=torch.device("cpu"), gather_output=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()  # one step: the export is not init
        optimizer.step()
        model.eval()
        with torch.no_grad():
            out[family] = model(input_ids=ids).logits
        sharded = f"{root}/{family}/sharded"
        parallelizer.save_model_sharded_checkpoint(model, sharded)
        collectives.barrier()
        if nxd_state.get_parallel_state().rank == 0:
            export_hf(sharded, f"{root}/{family}/hf")
        collectives.barrier()
    return out


@pytest.mark.slow
def test_plan_families_export_round_trip(tmp_path: pytest.TempPathFactory) -> None:
    """Trained one step at TP=2, saved sharded, exported by ``export_hf``: transformers loads
    the folder in one process and computes the TP model's logits (``OUT_TOL``)."""
    import transformers

    families = tuple(f for f in EXPORT_FAMILIES if f in R.families())
    ranks = run_distributed(_trained_and_saved, 2, str(tmp_path), families)
    ids = torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ), generator=torch.Generator().manual_seed(4))
    for family in families:
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family / "hf")
        with torch.no_grad():
            logits = exported.eval()(input_ids=ids).logits
        torch.testing.assert_close(ranks[0][family], ranks[1][family], rtol=0, atol=0)
        torch.testing.assert_close(logits, ranks[0][family], **R.OUT_TOL)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_sequence_parallel_with_replicated_embeddings(family: str) -> None:
    """``parallelize(sequence_parallel_enabled=True, parallelize_embeddings=False)``: the
    embedding and head stay whole on every rank, the sequence is split before the first layer
    and gathered before the head. Logits, loss and every gradient (norms summed over TP) equal
    the unsharded model's (``R.OUT_TOL`` / ``R.GRAD_TOL``); Llama through the Llama-family
    path, Gemma 2 through its tensor-parallel plan."""
    _skip_if_missing(family)
    for bad in run_distributed(_replicated_embeddings, 2, family):
        assert not bad, "\n".join(bad)


def _replicated_embeddings(family: str) -> list[str]:
    import nxd_state
    from nxd_layers import allreduce_sequence_parallel_gradients
    from nxd_trainer.hf import ParallelizersManager

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = R.H.model("llama").eval() if family == "llama" else R.build(family)
    ids = torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ), generator=torch.Generator().manual_seed(5))
    reference = copy.deepcopy(model)
    want = reference(input_ids=ids, labels=ids, use_cache=False)
    want.loss.backward()
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    parallel = parallelizer.parallelize(
        model,
        device=torch.device("cpu"),
        sequence_parallel_enabled=True,
        parallelize_embeddings=False,
    )
    out = parallel(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    allreduce_sequence_parallel_gradients(list(parallel.parameters()))
    checks = [
        ("logits", out.logits, want.logits, R.OUT_TOL),
        ("loss", out.loss, want.loss, R.OUT_TOL),
    ]
    ref_params = dict(reference.named_parameters())
    for name, param in parallel.named_parameters():
        grad = R.H.full(param, param.grad, name, parallel.config)
        ref = ref_params[parallelizer.hf_name(name)].grad
        checks.append((f"grad {name}", grad, ref, R.GRAD_TOL))
    bad = []
    for what, got, expected, tol in checks:
        try:
            torch.testing.assert_close(got.detach(), expected.detach(), **tol)
        except AssertionError as error:
            bad.append(f"{family} {what}: {error}")
    return bad
