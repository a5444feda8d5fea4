"""nxd-state: the process-group foundation of nxd.

A :class:`ParallelState` holds the tensor/pipeline/data parallel groups of a ``[PP, DP, TP]``
rank layout; NxD's ``parallel_state`` functions read the current one. Device and backend
selection, every collective (with an opt-in traffic counter) and the model-parallel RNG live
here too. The multi-rank test harness is :mod:`nxd_state.testing`.
"""

from importlib.metadata import version as _version

from nxd_state import collectives
from nxd_state.collectives import CollectiveCounter, count_collectives
from nxd_state.device import (
    backend_for,
    current_device,
    init_distributed,
    move_model_to_device,
    resolve_device_type,
)
from nxd_state.layout import ParallelLayout, RankCoordinates
from nxd_state.parallel_state import (
    ParallelState,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_size,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_parallel_state,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_size,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_world_group,
    initialize_model_parallel,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    model_parallel_is_initialized,
)
from nxd_state.rng import (
    RNGStatesTracker,
    get_rng_tracker,
    load_rng_state_dict,
    model_parallel_manual_seed,
    rng_state_dict,
)

__version__ = _version("nxd-state")

__all__ = [
    "CollectiveCounter",
    "ParallelLayout",
    "ParallelState",
    "RNGStatesTracker",
    "RankCoordinates",
    "__version__",
    "backend_for",
    "collectives",
    "count_collectives",
    "current_device",
    "destroy_model_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_size",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_parallel_state",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_size",
    "get_pipeline_model_parallel_world_size",
    "get_rng_tracker",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_size",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_world_group",
    "init_distributed",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "load_rng_state_dict",
    "model_parallel_is_initialized",
    "model_parallel_manual_seed",
    "move_model_to_device",
    "resolve_device_type",
    "rng_state_dict",
]
