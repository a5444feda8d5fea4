"""NxD's ``neuronx_distributed.parallel_layers.parallel_state``: :mod:`nxd_state`'s functions,
plus NxD's ``rmsg`` log prefix and its gloo pipeline groups (``initialize_pp_gloo_groups`` /
``get_pp_gloo_group``: a gloo group per pipeline group, for CPU objects such as
``pipeline.comm.send_python_object(..., method="gloo")``)."""

from __future__ import annotations

import logging

import torch.distributed as dist

from nxd_state.parallel_state import *  # noqa: F403
from nxd_state.parallel_state import __all__ as _state_all
from nxd_state.parallel_state import get_parallel_state, model_parallel_is_initialized
from nxd_state.state import ParallelState

__all__ = [
    *_state_all,
    "get_pp_gloo_group",
    "initialize_pp_gloo_groups",
    "rmsg",
]

logger = logging.getLogger(__name__)

# (the parallel state they belong to, this rank's gloo pipeline group)
_PP_GLOO: tuple[ParallelState, dist.ProcessGroup] | None = None


def initialize_pp_gloo_groups() -> None:
    """Create a gloo group over every pipeline group (collective: every rank calls it) and keep
    this rank's; a second call for the same parallel state logs an error and does nothing, as
    NxD's does."""
    global _PP_GLOO
    state = get_parallel_state()
    if _PP_GLOO is not None and _PP_GLOO[0] is state:
        logger.error("pp gloo groups are already initialized!")
        return
    mine: dist.ProcessGroup | None = None
    for ranks in state.layout.pipeline_parallel_groups():  # collective: every list, every rank
        group = state.group_for(ranks, backend="gloo")
        if group is not None:
            mine = group
    assert mine is not None
    _PP_GLOO = (state, mine)


def get_pp_gloo_group() -> dist.ProcessGroup:
    """This rank's gloo pipeline group (after :func:`initialize_pp_gloo_groups` for the current
    parallel state)."""
    if _PP_GLOO is None or _PP_GLOO[0] is not get_parallel_state():
        raise RuntimeError(
            "pp gloo groups are not initialized: call initialize_pp_gloo_groups() after "
            "initialize_model_parallel"
        )
    return _PP_GLOO[1]


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
