"""The tiny MoE block of the MoE tests: hidden 16, 4 experts, top-2, intermediate 8, float64
(float32 where a test runs torch's grouped products, which have no float64 kernel)."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from nxd_layers.moe import ExpertMLPsCapacityFactor, MoE, RouterTopK

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 16, 4, 2, 8


def tiny_moe(
    capacity_factor: float | None,
    *,
    act_fn: str = "softmax",
    normalize: bool = False,
    group: ProcessGroup | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> MoE:
    """The block, its weights drawn from ``seed`` (the same full weights at any EP degree)."""
    torch.manual_seed(seed)
    router = RouterTopK(EXPERTS, TOP_K, HIDDEN, dtype=dtype, act_fn=act_fn)
    experts = ExpertMLPsCapacityFactor(
        EXPERTS,
        TOP_K,
        HIDDEN,
        INTERMEDIATE,
        "silu",
        capacity_factor,
        True,
        normalize_top_k_affinities=normalize,
        dtype=dtype,
        expert_model_parallel_group=group,
    )
    return MoE(router, experts, return_router_logits=True)
