"""The parallel state object and NxD's ``parallel_state`` functions on top of it.

:class:`ParallelState` owns the process groups of one ``[PP, DP, TP]`` layout. Code that
communicates takes a state or a group explicitly; NxD's module-level getters
(``get_tensor_model_parallel_group()`` ...) read the *current* state, the one built by
:func:`initialize_model_parallel`, so NxD scripts keep working unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

from nxd_state.collectives import register_group_name
from nxd_state.layout import ParallelLayout, RankCoordinates

__all__ = [
    "ParallelState",
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
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_size",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_world_group",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "model_parallel_is_initialized",
]

logger = logging.getLogger(__name__)


def _build_family(
    name: str, all_groups: list[list[int]], rank: int
) -> tuple[ProcessGroup, list[int]]:
    """Create every group of one family (collective: all ranks call this in the same order)."""
    mine: tuple[ProcessGroup, list[int]] | None = None
    for ranks in all_groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            register_group_name(group, name)
            mine = (group, ranks)
    if mine is None:  # pragma: no cover - the layout covers every rank
        raise RuntimeError(f"rank {rank} is in no {name} group of {all_groups}")
    return mine


@dataclass(eq=False)
class ParallelState:
    """Process groups of a ``[PP, DP, TP]`` layout, seen from one rank.

    Build it with :meth:`build` on every rank (group creation is collective). Ranks and sizes
    are plain attributes; ``*_groups`` hold every group of a family as lists of global ranks,
    which is NxD's ``as_list=True`` form and what XLA collectives call replica groups.
    """

    layout: ParallelLayout
    rank: int
    coordinates: RankCoordinates
    tensor_parallel_group: ProcessGroup
    data_parallel_group: ProcessGroup
    pipeline_parallel_group: ProcessGroup
    model_parallel_group: ProcessGroup
    tensor_parallel_ranks: list[int] = field(default_factory=list)
    data_parallel_ranks: list[int] = field(default_factory=list)
    pipeline_parallel_ranks: list[int] = field(default_factory=list)
    model_parallel_ranks: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> ParallelState:
        """Create the TP, DP, PP and model-parallel groups of the default process group."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call nxd_state.init_distributed() "
                "(or torch.distributed.init_process_group) before initialize_model_parallel"
            )
        layout = ParallelLayout(
            world_size=dist.get_world_size(),
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        rank = dist.get_rank()
        register_group_name(dist.GroupMember.WORLD, "world")
        tp, tp_ranks = _build_family("tp", layout.tensor_parallel_groups(), rank)
        dp, dp_ranks = _build_family("dp", layout.data_parallel_groups(), rank)
        pp, pp_ranks = _build_family("pp", layout.pipeline_parallel_groups(), rank)
        mp, mp_ranks = _build_family("mp", layout.model_parallel_groups(), rank)
        logger.info(
            "rank %d: tp=%d pp=%d dp=%d at %s",
            rank,
            layout.tensor_parallel_size,
            layout.pipeline_parallel_size,
            layout.data_parallel_size,
            layout.coordinates(rank),
        )
        return cls(
            layout=layout,
            rank=rank,
            coordinates=layout.coordinates(rank),
            tensor_parallel_group=tp,
            data_parallel_group=dp,
            pipeline_parallel_group=pp,
            model_parallel_group=mp,
            tensor_parallel_ranks=tp_ranks,
            data_parallel_ranks=dp_ranks,
            pipeline_parallel_ranks=pp_ranks,
            model_parallel_ranks=mp_ranks,
        )

    # Sizes and ranks ------------------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.layout.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def tensor_parallel_rank(self) -> int:
        return self.coordinates.tp

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.coordinates.pp

    @property
    def data_parallel_rank(self) -> int:
        return self.coordinates.dp

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.coordinates.pp == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.coordinates.pp == self.pipeline_parallel_size - 1

    @property
    def pipeline_next_rank(self) -> int:
        """Global rank of the next stage (the first stage follows the last)."""
        ranks = self.pipeline_parallel_ranks
        return ranks[(self.coordinates.pp + 1) % len(ranks)]

    @property
    def pipeline_prev_rank(self) -> int:
        """Global rank of the previous stage (the last stage precedes the first)."""
        ranks = self.pipeline_parallel_ranks
        return ranks[(self.coordinates.pp - 1) % len(ranks)]

    def destroy(self) -> None:
        """Destroy this state's groups (the default group is left alone)."""
        for group in {
            self.tensor_parallel_group,
            self.data_parallel_group,
            self.pipeline_parallel_group,
            self.model_parallel_group,
        }:
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)


# NxD's module-level API: a thin layer over the current ParallelState --------------------
_CURRENT: ParallelState | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1
) -> ParallelState:
    """Build the process groups and make them current (NxD's entry point).

    Calling it again with the same sizes returns the current state; other sizes are an error
    (call :func:`destroy_model_parallel` first).
    """
    global _CURRENT
    if _CURRENT is not None:
        current = (_CURRENT.tensor_parallel_size, _CURRENT.pipeline_parallel_size)
        if current == (tensor_model_parallel_size, pipeline_model_parallel_size):
            return _CURRENT
        raise RuntimeError(
            f"model parallel is already initialized with tensor_model_parallel_size={current[0]}, "
            f"pipeline_model_parallel_size={current[1]}; cannot re-initialize with "
            f"tensor_model_parallel_size={tensor_model_parallel_size}, "
            f"pipeline_model_parallel_size={pipeline_model_parallel_size} without "
            f"destroy_model_parallel() first"
        )
    _CURRENT = ParallelState.build(tensor_model_parallel_size, pipeline_model_parallel_size)
    return _CURRENT


def model_parallel_is_initialized() -> bool:
    return _CURRENT is not None


def destroy_model_parallel() -> None:
    """Destroy the current state's groups; the default process group stays."""
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


# Megatron spellings, which NxD code also uses.
get_tensor_model_parallel_world_size = get_tensor_model_parallel_size
get_pipeline_model_parallel_world_size = get_pipeline_model_parallel_size
get_data_parallel_world_size = get_data_parallel_size


def get_tensor_model_parallel_group(as_list: bool = False) -> ProcessGroup | list[list[int]]:
    """This rank's TP group, or with ``as_list=True`` every TP group as lists of ranks."""
    state = get_parallel_state()
    return state.layout.tensor_parallel_groups() if as_list else state.tensor_parallel_group


def get_data_parallel_group(as_list: bool = False) -> ProcessGroup | list[list[int]]:
    """This rank's DP group, or with ``as_list=True`` every DP group as lists of ranks."""
    state = get_parallel_state()
    return state.layout.data_parallel_groups() if as_list else state.data_parallel_group


def get_pipeline_model_parallel_group(as_list: bool = False) -> ProcessGroup | list[list[int]]:
    """This rank's PP group, or with ``as_list=True`` every PP group as lists of ranks."""
    state = get_parallel_state()
    return state.layout.pipeline_parallel_groups() if as_list else state.pipeline_parallel_group


def get_model_parallel_group(as_list: bool = False) -> ProcessGroup | list[list[int]]:
    """This rank's TP x PP group, or with ``as_list=True`` every one as lists of ranks."""
    state = get_parallel_state()
    return state.layout.model_parallel_groups() if as_list else state.model_parallel_group


def get_world_group(as_list: bool = False) -> ProcessGroup | list[list[int]]:
    """The default group, or with ``as_list=True`` ``[[0, ..., world - 1]]``."""
    state = get_parallel_state()
    return [list(range(state.layout.world_size))] if as_list else dist.GroupMember.WORLD


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
