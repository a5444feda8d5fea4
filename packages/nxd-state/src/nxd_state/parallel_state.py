"""NxD's ``parallel_state`` functions, a thin layer over the current :class:`ParallelState`.

Code that communicates takes a state or a group explicitly; NxD's module-level getters
(``get_tensor_model_parallel_group()`` ...) read the *current* state, the one built by
:func:`initialize_model_parallel`, so NxD scripts keep working unchanged. ``*_replica_groups()``
return every group of a family as lists of global ranks (what ``as_list=True`` returns).
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed import ProcessGroup

from nxd_state.layout import check_positive_int
from nxd_state.state import KVSharedGroups, ParallelState

__all__ = [
    "KVSharedGroups",
    "ParallelState",
    "destroy_kv_group",
    "destroy_model_parallel",
    "get_context_model_parallel_group",
    "get_context_model_parallel_rank",
    "get_context_model_parallel_replica_groups",
    "get_context_model_parallel_size",
    "get_context_model_parallel_src_tgt_pairs",
    "get_data_context_parallel_group",
    "get_data_context_parallel_replica_groups",
    "get_data_context_parallel_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_replica_groups",
    "get_data_parallel_size",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_replica_groups",
    "get_expert_data_parallel_size",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_replica_groups",
    "get_expert_model_parallel_size",
    "get_kv_shared_group",
    "get_kv_shared_group_size",
    "get_kv_shared_replica_groups",
    "get_model_parallel_group",
    "get_parallel_state",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_replica_groups",
    "get_pipeline_model_parallel_size",
    "get_pipeline_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_replica_groups",
    "get_tensor_model_parallel_size",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_world_group",
    "get_zero1_sharding_groups",
    "initialize_kv_group",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "model_parallel_is_initialized",
]

logger = logging.getLogger(__name__)

Groups = list[list[int]]
_CURRENT: ParallelState | None = None


def _clamp_to_world(name: str, value: int, world_size: int) -> int:
    """NxD's rule: a degree above the world size means the whole world."""
    if isinstance(value, int) and not isinstance(value, bool) and value > world_size:
        logger.warning("%s=%d exceeds world_size=%d: using %d", name, value, world_size, world_size)
        return world_size
    return value


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    skip_collective_init: bool = False,
    lnc_size: int = 1,
    context_parallel_size: int = 1,
) -> ParallelState:
    """Build the process groups and make them current (NxD's entry point, NxD's signature).

    As in NxD, a TP or PP degree above the world size is clamped to it. ``context_parallel_size``
    splits each sequence over that many ranks (the CP groups sit between DP and TP in the rank
    order: see :mod:`nxd_state.layout`); TP x PP x CP must divide the world size, and
    DP = world / (TP x PP x CP). ``expert_model_parallel_size`` (EP) splits the experts of MoE
    layers over ``EP`` consecutive DP ranks; it must divide DP (a ValueError naming both on
    every rank, before any group is made), and the expert DP degree is DP / EP x CP.
    ``skip_collective_init`` (NxD: skip the warm-up all-reduce that
    initialises Neuron's collectives runtime) is accepted and changes nothing: no backend nxd
    drives needs a warm-up.
    ``lnc_size`` (NxD: logical NeuronCores per rank, which picks a replica-group order on trn2)
    is validated and has no effect: nxd always uses the row-major ``[PP, DP, TP]`` order.

    Calling it again with the same sizes returns the current state; other sizes are an error
    (call :func:`destroy_model_parallel` first).
    """
    global _CURRENT
    check_positive_int("expert_model_parallel_size", expert_model_parallel_size)
    check_positive_int("context_parallel_size", context_parallel_size)
    if not isinstance(skip_collective_init, bool):
        raise ValueError(f"skip_collective_init must be a bool, got {skip_collective_init!r}")
    check_positive_int("lnc_size", lnc_size)
    if dist.is_initialized():
        world = dist.get_world_size()
        tensor_model_parallel_size = _clamp_to_world(
            "tensor_model_parallel_size", tensor_model_parallel_size, world
        )
        pipeline_model_parallel_size = _clamp_to_world(
            "pipeline_model_parallel_size", pipeline_model_parallel_size, world
        )
    wanted = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    if _CURRENT is not None:
        _check_same_sizes(_CURRENT, wanted)
        return _CURRENT
    _CURRENT = ParallelState.build(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
    )
    return _CURRENT


def _check_same_sizes(current_state: ParallelState, wanted: tuple[int, int, int, int]) -> None:
    """A second initialisation must ask for the current (TP, PP, CP, EP) sizes."""
    current = (
        current_state.tensor_parallel_size,
        current_state.pipeline_parallel_size,
        current_state.context_parallel_size,
        current_state.expert_model_parallel_size,
    )
    if current == wanted:
        return
    raise RuntimeError(
        f"model parallel is already initialized with tensor_model_parallel_size={current[0]}, "
        f"pipeline_model_parallel_size={current[1]}, context_parallel_size={current[2]}, "
        f"expert_model_parallel_size={current[3]}; "
        f"cannot re-initialize with tensor_model_parallel_size={wanted[0]}, "
        f"pipeline_model_parallel_size={wanted[1]}, context_parallel_size={wanted[2]}, "
        f"expert_model_parallel_size={wanted[3]} without destroy_model_parallel() first"
    )


def model_parallel_is_initialized() -> bool:
    return _CURRENT is not None


def destroy_model_parallel() -> None:
    """Destroy the current state's groups, KV-shared groups included; the default group stays."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.destroy()
    _CURRENT = None


def get_parallel_state() -> ParallelState:
    """The current :class:`ParallelState`, or a clear error if there is none."""
    if _CURRENT is None:
        raise RuntimeError(
            "model parallel state is not initialized: call "
            "nxd_state.initialize_model_parallel(tensor_model_parallel_size=..., "
            "pipeline_model_parallel_size=...) first"
        )
    return _CURRENT


# Sizes and ranks ---------------------------------------------------------------------------
def get_tensor_model_parallel_size() -> int:
    return get_parallel_state().tensor_parallel_size


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tensor_parallel_rank


def get_pipeline_model_parallel_size() -> int:
    return get_parallel_state().pipeline_parallel_size


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pipeline_parallel_rank


def get_data_parallel_size() -> int:
    return get_parallel_state().data_parallel_size


def get_data_parallel_rank() -> int:
    return get_parallel_state().data_parallel_rank


def get_context_model_parallel_size() -> int:
    """CP degree: the number of ranks each sequence is split over."""
    return get_parallel_state().context_parallel_size


def get_context_model_parallel_rank() -> int:
    """This rank's position in its CP group (which slice of the sequence it holds)."""
    return get_parallel_state().context_parallel_rank


def get_context_model_parallel_src_tgt_pairs() -> Groups:
    """NxD's ring pairs ``[[src, tgt], ...]`` of every CP group (global ranks): CP rank ``i``
    sends to CP rank ``(i + 1) mod CP``; empty when CP = 1."""
    return get_parallel_state().layout.context_parallel_src_tgt_pairs()


def get_data_context_parallel_size() -> int:
    """DP x CP: the ranks that average gradients (Megatron's DP size with context parallel)."""
    return get_parallel_state().data_context_parallel_size


def get_expert_model_parallel_size() -> int:
    """EP degree: the ranks a MoE layer's experts are split over."""
    return get_parallel_state().expert_model_parallel_size


def get_expert_model_parallel_rank() -> int:
    """Rank in the EP group (``dp mod EP``): which slice of the experts this rank holds."""
    return get_parallel_state().expert_model_parallel_rank


def get_expert_data_parallel_size() -> int:
    """Expert DP degree = DP / EP x CP: the ranks holding the same experts."""
    return get_parallel_state().expert_data_parallel_size


def get_expert_data_parallel_rank() -> int:
    """Rank in the expert DP group."""
    return get_parallel_state().expert_data_parallel_rank


# Megatron spellings, which NxD code also uses.
get_tensor_model_parallel_world_size = get_tensor_model_parallel_size
get_pipeline_model_parallel_world_size = get_pipeline_model_parallel_size
get_data_parallel_world_size = get_data_parallel_size


# Replica groups: every group of a family, as lists of global ranks -------------------------
def get_tensor_model_parallel_replica_groups() -> Groups:
    return get_parallel_state().layout.tensor_parallel_groups()


def get_data_parallel_replica_groups() -> Groups:
    return get_parallel_state().layout.data_parallel_groups()


def get_pipeline_model_parallel_replica_groups() -> Groups:
    return get_parallel_state().layout.pipeline_parallel_groups()


def get_context_model_parallel_replica_groups() -> Groups:
    return get_parallel_state().layout.context_parallel_groups()


def get_expert_model_parallel_replica_groups() -> Groups:
    return get_parallel_state().layout.expert_model_parallel_groups()


def get_expert_data_parallel_replica_groups() -> Groups:
    return get_parallel_state().layout.expert_data_parallel_groups()


def get_data_context_parallel_replica_groups() -> Groups:
    return get_parallel_state().layout.data_context_parallel_groups()


def get_zero1_sharding_groups() -> Groups:
    """The groups ZeRO-1 shards optimizer state over: DP x CP (the DP groups when CP = 1)."""
    return get_parallel_state().layout.data_context_parallel_groups()


# Groups: this rank's process group, or with as_list=True the replica groups ----------------
def get_tensor_model_parallel_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's TP group, or with ``as_list=True`` every TP group as lists of ranks."""
    if as_list:
        return get_tensor_model_parallel_replica_groups()
    return get_parallel_state().tensor_parallel_group


def get_data_parallel_group(
    as_list: bool = False, *, with_context_parallel: bool = False
) -> ProcessGroup | Groups:
    """This rank's DP group, or with ``as_list=True`` every DP group as lists of ranks.

    The DP group holds the ranks that see different batches; with ``with_context_parallel=True``
    (Megatron's keyword) the DP x CP group, the one that averages gradients.
    """
    if with_context_parallel:
        return get_data_context_parallel_group(as_list)
    if as_list:
        return get_data_parallel_replica_groups()
    return get_parallel_state().data_parallel_group


def get_data_context_parallel_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's DP x CP group (gradient averaging, ZeRO-1 sharding), or with
    ``as_list=True`` every one as lists of ranks; the DP group when CP = 1."""
    if as_list:
        return get_data_context_parallel_replica_groups()
    group = get_parallel_state().data_context_parallel_group
    assert group is not None  # built by ParallelState.build
    return group


def get_pipeline_model_parallel_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's PP group, or with ``as_list=True`` every PP group as lists of ranks."""
    if as_list:
        return get_pipeline_model_parallel_replica_groups()
    return get_parallel_state().pipeline_parallel_group


def get_context_model_parallel_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's CP group (the ranks sharing its sequence), or with ``as_list=True`` every
    one as lists of ranks."""
    if as_list:
        return get_context_model_parallel_replica_groups()
    return get_parallel_state().context_parallel_group


def get_expert_model_parallel_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's EP group (``EP`` consecutive DP ranks), or with ``as_list=True`` every one."""
    if as_list:
        return get_expert_model_parallel_replica_groups()
    return get_parallel_state().expert_model_parallel_group


def get_expert_data_parallel_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's expert DP group (the ranks holding its experts; DP x CP when EP = 1), or
    with ``as_list=True`` every one."""
    if as_list:
        return get_expert_data_parallel_replica_groups()
    group = get_parallel_state().expert_data_parallel_group
    assert group is not None  # built by ParallelState.build
    return group


def get_model_parallel_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's TP x PP group, or with ``as_list=True`` every one as lists of ranks."""
    state = get_parallel_state()
    return state.layout.model_parallel_groups() if as_list else state.model_parallel_group


def get_world_group(as_list: bool = False) -> ProcessGroup | Groups:
    """The default group, or with ``as_list=True`` ``[[0, ..., world - 1]]``."""
    state = get_parallel_state()
    if as_list:
        return [list(range(state.layout.world_size))]
    world = dist.GroupMember.WORLD
    assert world is not None  # a ParallelState is built only over an initialised default group
    return world


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the broadcast source)."""
    return get_parallel_state().tensor_parallel_ranks[0]


def get_data_parallel_src_rank() -> int:
    """Global rank of DP rank 0 in this rank's DP group."""
    return get_parallel_state().data_parallel_ranks[0]


def get_pipeline_model_parallel_next_rank() -> int:
    return get_parallel_state().pipeline_next_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return get_parallel_state().pipeline_prev_rank


def is_pipeline_first_stage() -> bool:
    return get_parallel_state().is_pipeline_first_stage


def is_pipeline_last_stage() -> bool:
    return get_parallel_state().is_pipeline_last_stage


# KV-shared groups (GQA layers with kv_size_multiplier > 1) ---------------------------------
def initialize_kv_group(
    kv_shared_group_size: int = 1, sequential_ranks_in_group: bool = False
) -> None:
    """Build the KV-shared groups of the current state (collective; NxD's signature).

    A KV-shared group is the ``kv_shared_group_size`` TP ranks that hold replicas of the same
    KV heads (see :meth:`ParallelLayout.kv_shared_groups` for the two orders). Calling it again
    with the same arguments does nothing; other arguments are an error.
    """
    get_parallel_state().initialize_kv_groups(
        kv_shared_group_size, sequential_ranks_in_group=sequential_ranks_in_group
    )


def _kv_shared() -> KVSharedGroups:
    kv = get_parallel_state().kv_shared
    if kv is None:
        raise RuntimeError(
            "the KV-shared group is not initialized: call "
            "initialize_kv_group(kv_shared_group_size=...) first (GQA layers do when "
            "kv_size_multiplier > 1)"
        )
    return kv


def get_kv_shared_group(as_list: bool = False) -> ProcessGroup | Groups:
    """This rank's KV-shared group, or with ``as_list=True`` every one as lists of ranks."""
    return get_kv_shared_replica_groups() if as_list else _kv_shared().group


def get_kv_shared_replica_groups() -> Groups:
    return [list(ranks) for ranks in _kv_shared().all_groups]


def get_kv_shared_group_size() -> int:
    return _kv_shared().size


def destroy_kv_group() -> None:
    """Destroy the KV-shared groups of the current state, if any."""
    if _CURRENT is not None:
        _CURRENT.destroy_kv_groups()
