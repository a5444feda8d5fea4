"""Which process groups an optimizer communicates on, validated before any traffic.

Groups may be given as a ``ProcessGroup`` or in NxD's ``as_list`` form (every group of a family
as lists of global ranks, e.g. ``get_data_parallel_group(as_list=True)``); ``None`` means the
current nxd_state parallel state's group. The process groups of rank lists come from the parallel
state (:meth:`~nxd_state.ParallelState.partition_group`), which creates each once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import nxd_state
from nxd_state import ParallelState

__all__ = [
    "GroupSpec",
    "check_params_on_backend_device",
    "current_state_or_none",
    "refuse_expert_parallelism",
    "resolve_group",
    "resolve_sharding_group",
    "shard_norm_group",
]

GroupSpec = ProcessGroup | Sequence[Sequence[int]] | None

# Device types each backend moves (gloo also handles CUDA tensors).
_BACKEND_DEVICE_TYPES: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "xla": ("xla",),
}


def current_state_or_none() -> ParallelState | None:
    return nxd_state.get_parallel_state() if nxd_state.model_parallel_is_initialized() else None


def refuse_expert_parallelism(where: str, params: Iterable[torch.Tensor]) -> None:
    """Raise when the current state has EP > 1 and ``params`` hold experts
    (``expert_model_parallel``): one ZeRO-1 sharding group for every gradient would average
    different experts' gradients over DP x CP (EP ranks hold different experts), or, sharded
    over expert-DP alone, leave them EP times too large and count them once per EP rank in
    the norm. :class:`~nxd_optim.NeuronEPZero1Optimizer` shards them over expert-DP instead."""
    state = current_state_or_none()
    if state is None or state.expert_model_parallel_size == 1:
        return
    experts = [p for p in params if getattr(p, "expert_model_parallel", False)]
    if not experts:  # dense params only: replicated over DP x CP, ZeRO-1 as usual
        return
    raise NotImplementedError(
        f"{where}: {len(experts)} expert parameter(s) (expert_model_parallel) at "
        f"expert_model_parallel_size={state.expert_model_parallel_size}: one sharding group "
        "cannot hold them (EP ranks hold different experts); use NeuronEPZero1Optimizer "
        "(NxD's EP-aware ZeRO-1; NxDOptimizer with zero_one_enabled=True picks it at EP > 1), "
        "which shards experts over the expert data-parallel group"
    )


def _partition_group(lists: Sequence[Sequence[int]], what: str) -> ProcessGroup:
    """This rank's group of a partition of the world given as rank lists, from the current
    parallel state (:meth:`~nxd_state.ParallelState.partition_group`: its own group, or one it
    creates once; collective on first use)."""
    state = current_state_or_none()
    if state is None:
        raise RuntimeError(
            f"{what} given as rank lists {[list(g) for g in lists]} need an nxd_state parallel "
            "state to create their process groups: call "
            "nxd_state.initialize_model_parallel(...) first, or pass a ProcessGroup"
        )
    return state.partition_group(lists, what)[0]


def resolve_group(spec: GroupSpec, default: ProcessGroup | None, what: str) -> ProcessGroup:
    """A ``ProcessGroup`` for ``spec``; ``None`` gives ``default``."""
    if spec is None:
        if default is None:
            raise RuntimeError(
                f"no {what} given and no nxd_state parallel state to take it from: call "
                f"nxd_state.initialize_model_parallel(...) or pass {what} explicitly"
            )
        return default
    if isinstance(spec, ProcessGroup):
        ranks = dist.get_process_group_ranks(spec)
        if dist.get_rank() not in ranks:
            raise ValueError(f"{what} {ranks} does not contain this rank ({dist.get_rank()})")
        return spec
    return _partition_group(spec, what)


def resolve_sharding_group(spec: GroupSpec) -> tuple[ProcessGroup, list[int]]:
    """The group ZeRO-1 shards over, checked against the parallel layout; by default DP x CP
    (the DP group when CP = 1).

    Sharding is only meaningful over replicas: every rank of the group must hold the same
    tensor- and pipeline-parallel slice of the model (same TP and PP coordinates).
    """
    state = current_state_or_none()
    group = resolve_group(
        spec, state.data_context_parallel_group if state else None, "sharding_groups"
    )
    ranks = dist.get_process_group_ranks(group)
    if state is not None:
        mine = state.coordinates
        for rank in ranks:
            theirs = state.layout.coordinates(rank)
            if (theirs.tp, theirs.pp) != (mine.tp, mine.pp):
                raise ValueError(
                    f"sharding group {ranks} does not match the data-parallel layout: rank "
                    f"{rank} is at tp={theirs.tp}, pp={theirs.pp} but this rank "
                    f"({state.rank}) is at tp={mine.tp}, pp={mine.pp}; ZeRO-1 shards over "
                    f"replicas only (expected the data x context parallel group "
                    f"{state.data_context_parallel_ranks} or a subset of it)"
                )
    return group, ranks


def shard_norm_group(sharding_ranks: Sequence[int]) -> ProcessGroup | None:
    """The group that sums shard-local norms: sharding group (DP x CP) x pipeline stages (same TP
    rank).

    Grad shards are disjoint across the sharding group and across pipeline stages, so their
    squared norms add over both; tensor parallelism is reduced separately. ``None`` when the
    sharding group alone covers it (one pipeline stage). Collective on first use.
    """
    state = current_state_or_none()
    if state is None or state.pipeline_parallel_size == 1:
        return None
    layout = state.layout
    lists = []
    for tp in range(layout.tensor_parallel_size):
        lists.append(
            [
                layout.rank_of(pp=pp, dp=dp, cp=cp, tp=tp)
                for pp in range(layout.pipeline_parallel_size)
                for dp in range(layout.data_parallel_size)
                for cp in range(layout.context_parallel_size)
            ]
        )
    if sorted(sharding_ranks) != sorted(state.data_context_parallel_ranks):
        raise ValueError(
            f"with pipeline parallelism the grad norm needs the sharding group to be the whole "
            f"data x context parallel group {state.data_context_parallel_ranks}, got "
            f"{list(sharding_ranks)}"
        )
    return state.partition_group(lists, "grad norm groups (dp x cp x pp)")[0]


def check_params_on_backend_device(
    params: Iterable[torch.Tensor], group: ProcessGroup, where: str
) -> torch.device:
    """All params on one device that ``group``'s backend moves; returns that device."""
    backend = str(dist.get_backend(group)).lower()
    allowed = _BACKEND_DEVICE_TYPES.get(backend)
    device: torch.device | None = None
    for index, param in enumerate(params):
        if allowed is not None and param.device.type not in allowed:
            raise ValueError(
                f"{where}: param {index} (shape {tuple(param.shape)}) is on {param.device}, "
                f"but the {backend} process group moves {' or '.join(allowed)} tensors: move "
                f"the model to the device first"
            )
        if device is None:
            device = param.device
        elif param.device != device:
            raise ValueError(
                f"{where}: param {index} (shape {tuple(param.shape)}) is on {param.device}, "
                f"expected {device} like the params before it"
            )
    if device is None:
        raise ValueError(f"{where}: no parameters")
    return device
