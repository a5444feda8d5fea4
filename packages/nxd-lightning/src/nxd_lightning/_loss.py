"""The step's loss as the job reports it: L = (1/DP) Σ_DP L_dp, on the ranks that hold it.

A training step's loss exists where the model computed it: every rank at PP = 1, the last
pipeline stage at PP > 1 (every rank with ``broadcast_and_average_loss``). The ranks holding it
average it over their data-parallel group (one all-reduce of one number: every member of a DP
group sits on the same stage, so they all hold it). With ``log_rank0`` and PP > 1 the value is
then broadcast from the last stage over the pipeline group (NxD's extra communication, one
broadcast per step), so pipeline rank 0, global rank 0 included, holds it too.
"""

from __future__ import annotations

import torch

import nxd_state
from nxd_state import collectives

__all__ = ["reduce_step_loss"]


def reduce_step_loss(loss: torch.Tensor | None, log_rank0: bool) -> torch.Tensor | None:
    """The DP-mean of ``loss`` (None where this rank does not hold it); see module doc."""
    state = nxd_state.get_parallel_state()
    value = None
    if loss is not None:
        value = loss.detach().to(torch.float32).clone()
        collectives.all_reduce(value, group=state.data_parallel_group)
        value /= state.data_parallel_size
    if log_rank0 and state.pipeline_parallel_size > 1:
        last = nxd_state.ParallelLayout(
            world_size=torch.distributed.get_world_size(),
            tensor_parallel_size=state.tensor_parallel_size,
            pipeline_parallel_size=state.pipeline_parallel_size,
        ).rank_of(
            pp=state.pipeline_parallel_size - 1,
            dp=state.data_parallel_rank,
            tp=state.tensor_parallel_rank,
        )
        device = value.device if value is not None else nxd_state.current_device()
        buffer = value if value is not None else torch.zeros((), device=device)
        collectives.broadcast(buffer, src=last, group=state.pipeline_parallel_group)
        value = buffer
    return value
