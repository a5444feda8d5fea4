"""NxDPPModel's argument checks: run first, on every rank, before any collective."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from nxd_pipeline._loss import LossSpec, check_loss_spec

__all__ = ["XLA_RUNTIME_OPTIONS", "check_arguments"]

logger = logging.getLogger(__name__)

XLA_RUNTIME_OPTIONS = frozenset(
    {
        "_delay_tracing",
        "_turn_off_odd_even_scheduler",
        "_all_reduce_send_recv",
        "_fused_send_recv",
        "_fused_fwd_bwd",
        "_mark_step_before_pp_runtime",
        "_mark_step_after_pp_runtime",
        "_deallocate_send_tensors",
        "_use_gloo_for_metadata_comm",
    }
)
"""NxD's knobs for its XLA runtime (graph breaks, fused send/recv graphs, how metadata travels,
freeing sent outputs): accepted so NxD calls work unchanged; this runtime has no use for them."""


def check_arguments(
    module: nn.Module | Sequence[nn.Module],
    *,
    num_microbatches: int,
    virtual_pipeline_size: int,
    return_mb_loss: bool,
    broadcast_and_average_loss: bool,
    pipeline_cuts: list[str] | None,
    auto_partition: bool,
    output_loss_value_spec: LossSpec,
    manual_pp_partition: bool,
    manual_options: tuple[Any, ...],
    debug: tuple[bool, int, int],
    xla_runtime_options: dict[str, Any],
) -> None:
    """Raise on a bad or contradictory argument, naming it."""
    unknown = sorted(set(xla_runtime_options) - XLA_RUNTIME_OPTIONS)
    if unknown:
        raise TypeError(f"NxDPPModel got unexpected keyword arguments {unknown}")
    if xla_runtime_options:
        logger.debug("NxD XLA runtime options without effect here: %s", xla_runtime_options)
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    if not isinstance(virtual_pipeline_size, int) or virtual_pipeline_size < 1:
        raise ValueError(
            f"virtual_pipeline_size must be a positive int, got {virtual_pipeline_size!r}"
        )
    debug_mode, debug_size, debug_rank = debug
    if debug_mode and not (
        isinstance(debug_size, int) and isinstance(debug_rank, int) and 0 <= debug_rank < debug_size
    ):
        raise ValueError(
            f"_debug_mode=True needs _debug_pp_size >= 1 and 0 <= _debug_pp_rank < "
            f"_debug_pp_size, got _debug_pp_size={debug_size!r}, _debug_pp_rank={debug_rank!r}"
        )
    if return_mb_loss and broadcast_and_average_loss:
        raise ValueError(
            "return_mb_loss=True and broadcast_and_average_loss=True are exclusive: "
            "broadcast_and_average_loss requires return_mb_loss=False"
        )
    if auto_partition and pipeline_cuts:
        raise ValueError(
            f"auto_partition=True chooses the cuts itself; got pipeline_cuts={pipeline_cuts}"
        )
    check_loss_spec(output_loss_value_spec)
    if manual_pp_partition and (pipeline_cuts or auto_partition):
        raise ValueError(
            "manual_pp_partition=True splits the layer list itself: drop pipeline_cuts and "
            "auto_partition (use manual_pp_stage_partition_fn to choose the stages)"
        )
    if manual_pp_partition != isinstance(module, (list, tuple)):
        raise TypeError(
            "manual_pp_partition=True takes the model as a list of layers"
            if manual_pp_partition
            else f"a {type(module).__name__} of layers needs manual_pp_partition=True"
        )
    if not manual_pp_partition and any(option is not None for option in manual_options):
        logger.warning("manual_pp_* arguments are ignored without manual_pp_partition=True")
