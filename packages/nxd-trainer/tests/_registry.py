"""Every causal-LM family transformers ships, from a tiny config, through the parallelizer at
TP=2: for the ``test_hf_registry`` test and ``scripts/hf_coverage_table.py``.

Not a test module; loaded by path (``nxd_state.testing.load_sibling``).

A family's outcome is one of:

- ``parity``: logits (gathered over the vocabulary), loss and every parameter's gradient
  (gathered over TP) equal the unsharded model's;
- ``refused``: :class:`nxd_trainer.hf.UnsupportedModelError` (by config: no tensor-parallel
  plan, multimodal; or by inspecting the built model), its message kept;
- ``skipped``: the family does not build from its default config made tiny (reason kept);
- ``mismatch`` / ``error``: what must never happen (a silent wrong result, or another
  exception while parallelising or running).

Each family at parity is checked again with sequence parallelism (a second outcome of the
same kinds; ``n/a`` for the others).

Weights are drawn so every piece counts (matrices ``N(0, 1/fan_in)``, norm weights around 1,
biases ``N(0, 0.1)``): at transformers' init (std 0.02) an embedding scale or a soft-cap
changes the logits by less than the tolerance.
"""

from __future__ import annotations

import math
import traceback
import warnings
from typing import Any

import torch

from nxd_state.testing import load_sibling

H = load_sibling(__file__, "_hf")

SEQ, BATCH, VOCAB = 8, 2, 96
TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "attn_implementation": "eager",
}
"""Overrides applied where the default config has the attribute. A 4-token sliding window
on 8 tokens makes sliding layers differ from full ones."""

MAX_PARAMETERS = 2_000_000
"""A family whose config names its sizes otherwise stays big: skipped, not built (memory)."""

OUT_TOL = {"rtol": 1e-5, "atol": 1e-5}
"""fp32; TP=2 adds each row-parallel matmul's two partial sums in another order (round-off
~1e-7 relative on O(1) logits, a little more through soft-capping and 2 layers); a missing
scale, norm or head mix-up is off by O(1)."""
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}
"""Gradients of small entries pass through more such sums (as test_hf_parity)."""


def families() -> list[str]:
    """transformers' causal-LM families (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def refused_by_config(model_type: str) -> str | None:
    """The refusal's message when the family is refused from its type alone, else None."""
    from nxd_trainer.hf import ParallelizersManager, UnsupportedModelError

    try:
        ParallelizersManager.parallelizer_for_model(model_type)
    except UnsupportedModelError as error:
        return str(error)
    return None


def tiny_config(model_type: str) -> Any:
    """The family's default config with :data:`TINY` applied where it has the attribute;
    ``layer_types`` cycles through its kinds (alternating attention at 2 layers)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]  # (AutoConfig.for_model imports every family)
    default = config_class()
    kwargs = {k: v for k, v in TINY.items() if k == "attn_implementation" or hasattr(default, k)}
    if getattr(default, "pad_token_id", None) is not None:
        kwargs["pad_token_id"] = 0
    kinds = getattr(default, "layer_types", None)
    if kinds:
        unique = list(dict.fromkeys(kinds))
        kwargs["layer_types"] = [unique[i % len(unique)] for i in range(TINY["num_hidden_layers"])]
    return config_class(**kwargs)


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    """The family's causal LM from :func:`tiny_config`, weights drawn as the module says."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.device("meta"):  # a size left under another name must not build full size
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still has {size:,} parameters (sizes under other names)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 1 / math.sqrt(param.shape[-1]))
            elif "norm" in name or "ln" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    return model.eval()


def _run(model: torch.nn.Module, ids: torch.Tensor) -> Any:
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out


def _compare(
    parallel: torch.nn.Module, parallelizer: Any, out: Any, reference: Any, ref_grads: dict
) -> None:
    """Logits, loss and every parameter's gradient (gathered over TP) against the unsharded
    model's; AssertionError naming the first difference."""
    cfg = parallel.config
    logits = H.full_logits(out.logits.detach(), cfg.vocab_size)
    torch.testing.assert_close(logits, reference.logits.detach(), **OUT_TOL)
    torch.testing.assert_close(out.loss.detach(), reference.loss.detach(), **OUT_TOL)
    for name, param in parallel.named_parameters():
        hf = parallelizer.hf_name(name)
        if param.grad is None or hf not in ref_grads:
            assert param.grad is None, f"{name}: a gradient the unsharded model lacks"
            assert hf not in ref_grads, f"{name}: no gradient, the unsharded model has one"
            continue
        grad = H.full(param, param.grad, name, cfg)
        torch.testing.assert_close(
            grad, ref_grads[hf], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def _parallel_outcome(
    model_type: str, ids: torch.Tensor, reference: Any, ref_grads: dict, sp: bool
) -> tuple[str, str]:
    """Parallelise a fresh copy of the family at TP=2 (``sp``: with sequence parallelism,
    gradients of the norms on the split sequence summed over TP as NxDOptimizer does) and
    compare it with the unsharded run."""
    from nxd_layers import allreduce_sequence_parallel_gradients
    from nxd_trainer.hf import ParallelizersManager, UnsupportedModelError

    model = build(model_type)
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    try:
        parallel = parallelizer.parallelize(
            model, device=torch.device("cpu"), sequence_parallel_enabled=sp
        )
    except UnsupportedModelError as error:
        return "refused", str(error)
    except Exception:
        return "error", traceback.format_exc(limit=6)
    try:
        out = _run(parallel, ids)
        allreduce_sequence_parallel_gradients(list(parallel.parameters()))
        _compare(parallel, parallelizer, out, reference, ref_grads)
    except AssertionError as error:
        return "mismatch", str(error)[:2000]
    except Exception:
        return "error", traceback.format_exc(limit=6)
    what = "with sequence parallelism " if sp else ""
    return "parity", f"logits, loss and gradients equal at TP=2 {what}({parallelizer.__name__})"


def check_family(model_type: str) -> tuple[str, str, str, str]:
    """(outcome, detail) of one family on this rank at TP=2 (see the module docstring), then
    the same with sequence parallelism (``n/a`` where TP=2 is not at parity)."""
    from nxd_trainer.hf import ParallelizersManager, UnsupportedModelError

    try:
        model = build(model_type)
    except Exception as error:
        return (
            "skipped",
            f"does not build from a tiny default config: {type(error).__name__}: {error}",
            "n/a",
            "",
        )
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    try:  # the refusal first (parallelize repeats it): no reference run for refused families
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
        parallelizer.inspect(model)
    except UnsupportedModelError as error:
        return "refused", str(error), "n/a", ""
    except Exception:
        return "error", traceback.format_exc(limit=6), "n/a", ""
    try:
        reference = _run(model, ids)
    except Exception as error:
        why = f"the unsharded tiny model does not run: {type(error).__name__}: {error}"
        return "skipped", why, "n/a", ""
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    outcome = _parallel_outcome(model_type, ids, reference, ref_grads, sp=False)
    if outcome[0] != "parity":
        return (*outcome, "n/a", "")
    return (*outcome, *_parallel_outcome(model_type, ids, reference, ref_grads, sp=True))


def check_families(model_types: list[str]) -> dict[str, tuple[str, str, str, str]]:
    """:func:`check_family` for each, on one TP=2 group (run under ``run_distributed``)."""
    import transformers

    import nxd_state

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return {model_type: check_family(model_type) for model_type in model_types}
