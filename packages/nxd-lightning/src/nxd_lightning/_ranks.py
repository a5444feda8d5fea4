"""Which rank speaks for the job: the one that holds the loss.

With pipeline parallelism the loss exists on the last stage only; every DP replica and TP rank
there holds the same (DP-averaged) value. One rank shows it: data-parallel rank 0,
tensor-parallel rank 0, pipeline rank ``PP - 1`` (NxD's default), or pipeline rank 0 when
``log_rank0`` is set (the loss is then broadcast over the pipeline group once per step), which
is global rank 0.
"""

from __future__ import annotations

import nxd_state

__all__ = ["is_logging_rank", "logging_pipeline_rank"]


def logging_pipeline_rank(log_rank0: bool) -> int:
    """The pipeline rank whose ranks log: 0 with ``log_rank0``, else the last stage."""
    return 0 if log_rank0 else nxd_state.get_pipeline_model_parallel_size() - 1


def is_logging_rank(log_rank0: bool) -> bool:
    """Whether this process is the one rank that writes progress and logs."""
    if not nxd_state.model_parallel_is_initialized():
        raise RuntimeError(
            "model parallelism is not initialised: the NxD strategy sets it up when the "
            "Trainer starts (use nxd_lightning's strategy)"
        )
    return (
        nxd_state.get_data_parallel_rank() == 0
        and nxd_state.get_tensor_model_parallel_rank() == 0
        and nxd_state.get_pipeline_model_parallel_rank() == logging_pipeline_rank(log_rank0)
    )
