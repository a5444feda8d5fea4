"""Tiny Mixtral, Qwen2-MoE and Qwen3-MoE models and their batches, for the expert-parallel
tests (``test_hf_moe_ep``, ``test_hf_moe_trainer``).

Not a test module; loaded by path (``nxd_state.testing.load_sibling``).
"""

from __future__ import annotations

import torch

from nxd_state.testing import load_sibling

R = load_sibling(__file__, "_registry")

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
NORM_TOPK = {"qwen2_moe": False, "qwen3_moe": True}
"""Each Qwen family with the other routing normalisation than its sibling's."""
EXPERTS = 4
"""``_registry.TINY``: 4 experts, top-2, 2 layers, hidden 32, vocabulary 96."""


def moe_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model (``_registry.build``), the router's logits returned and its
    auxiliary loss added to the loss (``output_router_logits=True``)."""
    model = R.build(family, seed)
    model.config.output_router_logits = True
    if family in NORM_TOPK:
        for module in model.modules():
            if hasattr(module, "norm_topk_prob"):
                module.norm_topk_prob = NORM_TOPK[family]
    return model


def batches(count: int, seed: int = 7) -> list[torch.Tensor]:
    """``count`` batches of ``R.BATCH`` x ``R.SEQ`` token ids (one per DP rank)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ), generator=g) for _ in range(count)]


def is_expert(param: torch.Tensor) -> bool:
    """An expert weight sharded over EP (nxd-optim's mark)."""
    return bool(getattr(param, "expert_model_parallel", False))
