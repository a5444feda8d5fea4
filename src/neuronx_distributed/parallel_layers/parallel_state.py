"""NxD's ``neuronx_distributed.parallel_layers.parallel_state``: :mod:`nxd_state`'s functions,
plus NxD's ``rmsg`` log prefix."""

from __future__ import annotations

import torch.distributed as dist

from nxd_state.parallel_state import *  # noqa: F403
from nxd_state.parallel_state import __all__ as _state_all
from nxd_state.parallel_state import get_parallel_state, model_parallel_is_initialized

__all__ = [*_state_all, "get_context_model_parallel_src_tgt_pairs", "rmsg"]


def rmsg(message: str) -> str:
    """``[rank_<global>_pp<p>_tp<t>_dp<d>] message``; -1 for what is not initialised yet."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    if model_parallel_is_initialized():
        state = get_parallel_state()
        pp, tp, dp = (
            state.pipeline_parallel_rank,
            state.tensor_parallel_rank,
            state.data_parallel_rank,
        )
    else:
        pp = tp = dp = -1
    return f"[rank_{rank}_pp{pp}_tp{tp}_dp{dp}] {message}"


def get_context_model_parallel_src_tgt_pairs() -> list[list[int]]:
    """The (source, target) rank pairs of ring attention's context-parallel exchange: none at
    context-parallel size 1, the only size nxd supports."""
    get_parallel_state()  # the same "not initialized" error as every getter
    return []
