"""nxd-pipeline: pipeline parallelism with NeuronX Distributed's ``NxDPPModel``.

Graph capture (torch.fx, or torch.export for Hugging Face models), partitioning at layer names
with original parameter names, or NxD's manual mode (a list of layers split into stages);
schedules as data (GPipe, 1F1B, interleaved 1F1B, ZB-H1) that are validated and dry-run
without processes, and a runtime whose point-to-point transfers go through
:mod:`nxd_state.collectives`.
"""

from importlib.metadata import version as _version

from nxd_pipeline._actions import Action, ActionKind
from nxd_pipeline._backward import backward_full, backward_input, backward_weight
from nxd_pipeline._comm import recv_from, send
from nxd_pipeline._loss import select_loss
from nxd_pipeline._manual import PipelineStageModule
from nxd_pipeline._model import NxDPPModel
from nxd_pipeline._options import XLA_RUNTIME_OPTIONS, PipelineOptions
from nxd_pipeline._partition import PartitionPlan, auto_pipeline_cuts, partition_graph
from nxd_pipeline._schedules import (
    SCHEDULE_NAMES,
    PipelineSchedule,
    build_schedule,
    stage_to_rank,
)
from nxd_pipeline._shared import mark_weight_sharing
from nxd_pipeline._timeline import ActionTiming, Timeline, format_timeline
from nxd_pipeline._trace import CapturedGraph, PipelineTraceError, capture_graph
from nxd_pipeline._validate import DryRun, ScheduleError, dry_run, format_grid, validate_schedule

__version__ = _version("nxd-pipeline")

__all__ = [
    "SCHEDULE_NAMES",
    "XLA_RUNTIME_OPTIONS",
    "Action",
    "ActionKind",
    "ActionTiming",
    "CapturedGraph",
    "DryRun",
    "NxDPPModel",
    "PartitionPlan",
    "PipelineOptions",
    "PipelineSchedule",
    "PipelineStageModule",
    "PipelineTraceError",
    "ScheduleError",
    "Timeline",
    "__version__",
    "auto_pipeline_cuts",
    "backward_full",
    "backward_input",
    "backward_weight",
    "build_schedule",
    "capture_graph",
    "dry_run",
    "format_grid",
    "format_timeline",
    "mark_weight_sharing",
    "partition_graph",
    "recv_from",
    "select_loss",
    "send",
    "stage_to_rank",
    "validate_schedule",
]
