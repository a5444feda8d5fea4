"""Tiny Hugging Face causal LMs of every supported family, and gathering a parallel model's
gradients back to the unsharded names and shapes, for the ``nxd_trainer.hf`` tests.

Not a test module; test files load it by path (``nxd_state.testing.load_sibling``), as
``_recipe.py``.

Gathering uses nxd_layers' ``full_tensor`` (the layers' own sharding attributes), then undoes
two layouts by hand, independently of the parallelizer's code: GQA K/V heads replicated head
by head (``[k0, k0, k1, k1]``: the copies must be equal, the first is kept) and vocabulary
padding (rows past ``vocab_size`` must be zero, they are dropped).
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ, BATCH = 96, 8, 2
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def config(
    family: str,
    *,
    vocab: int = VOCAB,
    kv_heads: int | None = None,
    heads: int = 4,
    hidden: int = 32,
) -> Any:
    """A 2-layer, hidden-32 config; Mistral with 1 KV head (GQA replication already at TP=2),
    Qwen2 with tied embeddings and Q/K/V biases, Qwen3 with Q/K norms and head_dim 16."""
    import transformers

    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "max_position_embeddings": 32,
        "attn_implementation": "eager",
    }
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=kv_heads or 2)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, num_key_value_heads=kv_heads or 1)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(
            **common, num_key_value_heads=kv_heads or 2, tie_word_embeddings=True
        )
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, num_key_value_heads=kv_heads or 2, head_dim=16)
    else:
        raise ValueError(family)
    return cfg


def model(family: str, seed: int = 0, **kwargs: Any) -> torch.nn.Module:
    """The family's causal LM with random weights from ``seed`` (biases made non-zero)."""
    import transformers

    torch.manual_seed(seed)
    out = transformers.AutoModelForCausalLM.from_config(config(family, **kwargs))
    with torch.no_grad():
        for name, param in out.named_parameters():
            if name.endswith("bias") or "norm" in name:  # 0 / 1 at init: make them count
                param.add_(0.1 * torch.randn_like(param))
    return out


def batch(seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def full(param: torch.Tensor, tensor: torch.Tensor, name: str, cfg: Any) -> torch.Tensor:
    """``tensor`` (``param`` or its gradient), gathered over TP and in the unsharded layout."""
    from nxd_layers import full_tensor

    out = full_tensor(param, tensor) if getattr(param, "tensor_model_parallel", False) else tensor
    replicas = getattr(param, "tensor_parallel_replicas", 1)
    if replicas > 1:  # GQA K/V: (kv heads x copies x head_dim, ...) -> first copies
        kv = cfg.num_key_value_heads
        copies = out.reshape(kv, replicas, -1, *out.shape[1:])
        for copy in range(1, replicas):
            torch.testing.assert_close(copies[:, copy], copies[:, 0], rtol=0, atol=0)
        out = copies[:, 0].reshape(-1, *out.shape[1:])
    if name.endswith(("embed_tokens.weight", "lm_head.weight")) and out.shape[0] > cfg.vocab_size:
        assert not out[cfg.vocab_size :].any(), f"{name}: padding rows are not zero"
        out = out[: cfg.vocab_size]
    return out


def mismatches(checks: list[tuple[str, Any, Any]], **tolerance: float) -> list[str]:
    """``"what: error"`` for every ``(what, got, want)`` that ``assert_close`` (with
    ``tolerance``) rejects: every check runs, so a rank reports all its mismatches at once."""
    bad = []
    for what, got, want in checks:
        try:
            torch.testing.assert_close(got, want, **tolerance)
        except AssertionError as error:
            bad.append(f"{what}: {error}")
    return bad


def full_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Vocabulary-sharded logits gathered over TP, padding columns dropped."""
    import nxd_state
    from nxd_state import collectives

    group = nxd_state.get_parallel_state().tensor_parallel_group
    gathered = collectives.all_gather(logits.contiguous(), group=group, dim=-1)
    return gathered[..., :vocab]


# Below transformers 5.20.2 (bisected: 5.20.1 fails, 5.20.2 passes, torch 2.9 and 2.15 alike)
# the torch.export capture of a parallelized HF model, which is on the meta device, lifts a
# tensor constant made in the model's forward on meta: its value never exists. The pipeline
# names it when it builds the stages (a PipelineTraceError); tests of HF models at PP > 1 check
# that error on those versions (the `lowest` session) instead of training.
PIPELINE_FIRST_GOOD_TRANSFORMERS = "5.20.2"


def pipeline_capture_works() -> bool:
    """Whether the installed transformers can be captured into pipeline stages on meta."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(PIPELINE_FIRST_GOOD_TRANSFORMERS)
