"""The parallel state object: the process groups of one ``[PP, DP, CP, TP]`` layout, one rank's
view.

Building it creates every group of every family on every rank (``new_group`` is collective over
the default group, so all ranks make the same calls in the same order); each rank keeps the
group it belongs to. The KV-shared groups of GQA layers are built later, on demand, by
:meth:`ParallelState.initialize_kv_groups`, and groups of any other rank lists by
:meth:`ParallelState.group_for`; they belong to the same state. Every group is created by
:func:`nxd_state.collectives.new_group`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from nxd_state.collectives import new_group, register_group_name
from nxd_state.layout import ParallelLayout, RankCoordinates

__all__ = ["KVSharedGroups", "ParallelState"]

logger = logging.getLogger(__name__)


def _build_family(
    name: str, all_groups: list[list[int]], rank: int
) -> tuple[ProcessGroup, list[int]]:
    """Create every group of one family (collective: all ranks call this in the same order)."""
    mine: tuple[ProcessGroup, list[int]] | None = None
    for ranks in all_groups:
        group = new_group(ranks, name)
        if rank in ranks:
            assert group is not None  # a member gets its group
            mine = (group, ranks)
    if mine is None:  # pragma: no cover - the layout covers every rank
        raise RuntimeError(f"rank {rank} is in no {name} group of {all_groups}")
    return mine


def _build_families(layout: ParallelLayout, rank: int) -> dict[str, Any]:
    """Create every group of every family of ``layout`` (collective), as the
    :class:`ParallelState` fields ``*_group`` and ``*_ranks`` of ``rank``.

    With CP = 1 the DP x CP group is the DP group; with EP = 1 the expert DP group is the
    DP x CP group (not built twice).
    """
    same_as: dict[str, str] = {}
    if layout.context_parallel_size == 1:
        same_as["data_context_parallel"] = "data_parallel"
    if layout.expert_model_parallel_size == 1:
        same_as["expert_data_parallel"] = "data_context_parallel"
    fields: dict[str, Any] = {}
    for family, name, all_groups in (
        ("tensor_parallel", "tp", layout.tensor_parallel_groups()),
        ("data_parallel", "dp", layout.data_parallel_groups()),
        ("pipeline_parallel", "pp", layout.pipeline_parallel_groups()),
        ("model_parallel", "mp", layout.model_parallel_groups()),
        ("context_parallel", "cp", layout.context_parallel_groups()),
        ("data_context_parallel", "dp_cp", layout.data_context_parallel_groups()),
        ("expert_model_parallel", "ep", layout.expert_model_parallel_groups()),
        ("expert_data_parallel", "edp", layout.expert_data_parallel_groups()),
    ):
        if family in same_as:
            group, ranks = fields[f"{same_as[family]}_group"], fields[f"{same_as[family]}_ranks"]
        else:
            group, ranks = _build_family(name, all_groups, rank)
        fields[f"{family}_group"], fields[f"{family}_ranks"] = group, ranks
    return fields


def _release(group: ProcessGroup) -> None:
    """Let go of a group nxd made: destroy it, unless it is gloo's.

    Groups built right after gloo groups were destroyed can fail to connect ("Gloo
    connectFullMesh failed ... Connection closed by peer"): reproduced on torch 2.9 and 2.15
    by destroying groups of 8 ranks as soon as they are built and building others (see
    ``tests/test_rebuild_groups.py``; a barrier after the destroy does not prevent it, so the
    race is inside gloo's teardown). Gloo groups are therefore only dropped, as Megatron's and
    NxD's ``destroy_model_parallel`` drop theirs: torch keeps them, a few sockets each, until
    the default group goes. NCCL (and XLA) groups are destroyed, which frees their
    communicators.
    """
    if "gloo" in str(dist.get_backend(group)):
        return
    dist.destroy_process_group(group)


@dataclass(frozen=True, eq=False)
class KVSharedGroups:
    """The KV-shared groups (NxD's ``initialize_kv_group``) of one state, seen from one rank."""

    size: int
    """``kv_shared_group_size``: ranks holding replicas of the same KV heads (the GQA
    layer's ``kv_size_multiplier``)."""
    sequential_ranks_in_group: bool
    """Adjacent ranks share a head (True) or ranks ``TP / size`` apart do (False, NxD's
    default); see :meth:`ParallelLayout.kv_shared_groups`."""
    group: ProcessGroup
    """This rank's KV-shared group."""
    ranks: list[int]
    """Global ranks of this rank's group."""
    all_groups: list[list[int]]
    """Every KV-shared group as lists of global ranks (NxD's replica groups)."""


@dataclass(eq=False)
class ParallelState:
    """Process groups of a ``[PP, DP, CP, TP]`` layout, seen from one rank.

    Build it with :meth:`build` on every rank (group creation is collective). Ranks and sizes
    are plain attributes; ``*_groups`` of the layout hold every group of a family as lists of
    global ranks, which is NxD's ``as_list=True`` form and what XLA collectives call replica
    groups. ``data_context_parallel_group`` (DP x CP) is the group that averages gradients and
    shards ZeRO-1 state; with CP = 1 it is the data-parallel group itself. The EP group is
    ``EP`` consecutive DP ranks (a MoE layer's all-to-all); the expert DP group holds the
    ranks with the same experts (expert gradients are averaged there). With EP = 1 the EP
    group is this rank alone and the expert DP group is the DP x CP group.
    """

    layout: ParallelLayout
    rank: int
    coordinates: RankCoordinates
    tensor_parallel_group: ProcessGroup
    data_parallel_group: ProcessGroup
    pipeline_parallel_group: ProcessGroup
    model_parallel_group: ProcessGroup
    context_parallel_group: ProcessGroup
    expert_model_parallel_group: ProcessGroup
    tensor_parallel_ranks: list[int] = field(default_factory=list)
    data_parallel_ranks: list[int] = field(default_factory=list)
    pipeline_parallel_ranks: list[int] = field(default_factory=list)
    model_parallel_ranks: list[int] = field(default_factory=list)
    context_parallel_ranks: list[int] = field(default_factory=list)
    """Global ranks of this rank's CP group, in CP-rank order."""
    data_context_parallel_group: ProcessGroup | None = None
    """DP x CP: the replicas of this rank's TP/PP slice (gradient averaging, ZeRO-1)."""
    data_context_parallel_ranks: list[int] = field(default_factory=list)
    expert_model_parallel_ranks: list[int] = field(default_factory=list)
    """Global ranks of this rank's EP group, in EP-rank order."""
    expert_data_parallel_group: ProcessGroup | None = None
    """The ranks holding this rank's experts (expert gradient averaging)."""
    expert_data_parallel_ranks: list[int] = field(default_factory=list)
    kv_shared: KVSharedGroups | None = None
    """The KV-shared groups, once :meth:`initialize_kv_groups` has built them."""
    _subgroups: dict[tuple[tuple[int, ...], str | None], ProcessGroup | None] = field(
        default_factory=dict, init=False, repr=False
    )
    """Groups :meth:`group_for` created, by their rank lists (``None``: this rank is outside)."""

    @classmethod
    def build(
        cls,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        *,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
    ) -> ParallelState:
        """Create the TP, DP, PP, model-parallel, CP, DP x CP and EP groups of the default process
        group.

        Bad degrees (an EP that does not divide DP included) raise on every rank before any
        group exists.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call nxd_state.init_distributed() "
                "(or torch.distributed.init_process_group) before initialize_model_parallel"
            )
        layout = ParallelLayout(
            world_size=dist.get_world_size(),
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
        )
        rank = dist.get_rank()
        world = dist.GroupMember.WORLD
        assert world is not None  # dist.is_initialized() was checked above
        register_group_name(world, "world")
        families = _build_families(layout, rank)
        logger.info(
            "rank %d: tp=%d pp=%d dp=%d cp=%d ep=%d at %s",
            rank,
            layout.tensor_parallel_size,
            layout.pipeline_parallel_size,
            layout.data_parallel_size,
            layout.context_parallel_size,
            layout.expert_model_parallel_size,
            layout.coordinates(rank),
        )
        return cls(layout=layout, rank=rank, coordinates=layout.coordinates(rank), **families)

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
    def context_parallel_size(self) -> int:
        return self.layout.context_parallel_size

    @property
    def data_context_parallel_size(self) -> int:
        return self.layout.data_context_parallel_size

    @property
    def expert_model_parallel_size(self) -> int:
        return self.layout.expert_model_parallel_size

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
    def context_parallel_rank(self) -> int:
        return self.coordinates.cp

    @property
    def expert_data_parallel_size(self) -> int:
        return self.layout.expert_data_parallel_size

    @property
    def expert_model_parallel_rank(self) -> int:
        return self.layout.expert_model_parallel_rank(self.rank)

    @property
    def expert_data_parallel_rank(self) -> int:
        return self.layout.expert_data_parallel_rank(self.rank)

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

    # KV-shared groups (GQA with replicated KV heads) ------------------------------------
    def initialize_kv_groups(
        self, kv_shared_group_size: int = 1, *, sequential_ranks_in_group: bool = False
    ) -> KVSharedGroups:
        """Build the KV-shared groups (collective), or return them if built with the same
        arguments; other arguments are an error (one KV layout per state, as in NxD)."""
        if self.kv_shared is not None:
            built = self.kv_shared
            if (built.size, built.sequential_ranks_in_group) == (
                kv_shared_group_size,
                sequential_ranks_in_group,
            ):
                return built
            raise ValueError(
                f"KV-shared groups already exist with kv_shared_group_size={built.size}, "
                f"sequential_ranks_in_group={built.sequential_ranks_in_group}; cannot build "
                f"kv_shared_group_size={kv_shared_group_size}, sequential_ranks_in_group="
                f"{sequential_ranks_in_group} (one KV layout for all layers; "
                f"destroy_kv_group() first)"
            )
        if not isinstance(sequential_ranks_in_group, bool):
            raise ValueError(
                f"sequential_ranks_in_group must be a bool, got {sequential_ranks_in_group!r}"
            )
        all_groups = self.layout.kv_shared_groups(
            kv_shared_group_size, sequential_ranks_in_group=sequential_ranks_in_group
        )
        group, ranks = _build_family("kv", all_groups, self.rank)
        self.kv_shared = KVSharedGroups(
            size=kv_shared_group_size,
            sequential_ranks_in_group=sequential_ranks_in_group,
            group=group,
            ranks=ranks,
            all_groups=all_groups,
        )
        logger.info("rank %d: kv-shared group %s", self.rank, ranks)
        return self.kv_shared

    def destroy_kv_groups(self) -> None:
        """Destroy the KV-shared groups, if any (gloo's are dropped: see :func:`_release`)."""
        if self.kv_shared is not None:
            _release(self.kv_shared.group)
            self.kv_shared = None

    # Groups of other rank lists ------------------------------------------------------------
    def group_for(self, ranks: Sequence[int], backend: str | None = None) -> ProcessGroup | None:
        """The process group of ``ranks`` (global ranks), created once per state and backend,
        with nxd's group timeout on ``backend`` (default: the default group's;
        :func:`nxd_state.collectives.new_group`); ``None`` on a rank outside ``ranks``.

        Collective the first time a rank list is asked for: every rank calls it with the same
        ranks in the same order, members or not. Later calls return the same group.
        """
        members = tuple(int(r) for r in ranks)
        key = (members, backend)
        if key not in self._subgroups:
            logger.info("rank %d: creating process group %s", self.rank, list(members))
            self._subgroups[key] = new_group(members, backend=backend)
        return self._subgroups[key]

    def partition_group(
        self, groups: Sequence[Sequence[int]], what: str = "groups"
    ) -> tuple[ProcessGroup, list[int]]:
        """This rank's group, and its ranks, of a partition of the world given as rank lists
        (NxD's ``as_list`` form); ``what`` names them in errors.

        A partition that is one of this state's families (TP, DP, PP, DP x CP) gives the
        state's own group; any other is created with :meth:`group_for`, list by list
        (collective on first use: every rank calls it with the same partition).
        """
        world = self.layout.world_size
        lists = [tuple(int(r) for r in ranks) for ranks in groups]
        if sorted(r for ranks in lists for r in ranks) != list(range(world)):
            raise ValueError(
                f"{what} {[list(g) for g in lists]} must partition the world's ranks "
                f"0..{world - 1} (each rank in exactly one group)"
            )
        if len({len(g) for g in lists}) != 1:
            raise ValueError(f"{what} {[list(g) for g in lists]} have unequal sizes")
        mine = next(g for g in lists if self.rank in g)
        for group, family in (
            (self.data_parallel_group, self.layout.data_parallel_groups()),
            (self.data_context_parallel_group, self.layout.data_context_parallel_groups()),
            (self.tensor_parallel_group, self.layout.tensor_parallel_groups()),
            (self.pipeline_parallel_group, self.layout.pipeline_parallel_groups()),
        ):
            # A state built by hand may lack the DP x CP group: then it is not reused.
            if group is not None and {tuple(g) for g in family} == set(lists):
                return group, list(mine)
        created = [self.group_for(g) for g in lists]  # every rank creates every list's group
        group = created[lists.index(mine)]
        if group is None:  # pragma: no cover - this rank is in `mine`: torch gave it its group
            raise RuntimeError(f"{what}: no group was created for rank {self.rank} in {list(mine)}")
        return group, list(mine)

    def destroy(self) -> None:
        """Destroy this state's groups, KV-shared ones and :meth:`group_for`'s included (the
        default group stays; gloo groups are dropped: see :func:`_release`)."""
        self.destroy_kv_groups()
        for subgroup in self._subgroups.values():
            if subgroup is not None:
                _release(subgroup)
        self._subgroups.clear()
        for group in {
            self.tensor_parallel_group,
            self.data_parallel_group,
            self.pipeline_parallel_group,
            self.model_parallel_group,
            self.context_parallel_group,
            self.data_context_parallel_group,
            self.expert_model_parallel_group,
            self.expert_data_parallel_group,
        }:
            if group is not None and group is not dist.GroupMember.WORLD:
                _release(group)
