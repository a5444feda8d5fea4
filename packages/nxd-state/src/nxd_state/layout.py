"""Rank layout: pure arithmetic on the ``[PP, DP, CP, TP]`` mesh, no communication.

Global ranks are laid out row-major over ``(pp, dp, cp, tp)`` with TP innermost and context
parallelism (CP) between DP and TP, the order of NxD and Megatron-core::

    rank = ((pp_rank * DP + dp_rank) * CP + cp_rank) * TP + tp_rank

so a tensor-parallel group is a run of ``TP`` consecutive ranks (the ranks that talk most
share a node), a context-parallel group strides by ``TP``, a data-parallel group by
``CP * TP`` and a pipeline group by ``DP * CP * TP``. With ``CP = 1`` this is the
``[PP, DP, TP]`` layout, rank for rank.

The ranks of a CP group hold the same weights and see the same batch, each a slice of its
sequence; their gradients are partial sums over the sequence, so gradients are reduced (and
ZeRO-1 shards state) over the *DP x CP* group (:meth:`ParallelLayout.data_context_parallel_
groups`), while data loaders shard batches over DP alone.

Expert parallelism (EP) is carved out of data parallelism, as in NxD and Megatron: the DP
coordinate splits as ``dp = dp_exp * EP + ep_rank``, so an EP group is ``EP`` consecutive DP
ranks (same ``pp``, ``cp``, ``tp``), each holding ``E / EP`` of a MoE layer's experts. The
ranks holding the *same* experts (same ``pp``, ``tp``, ``ep_rank``; any ``dp_exp`` and ``cp``)
form the expert data-parallel group of size ``DP / EP * CP``: expert gradients are averaged
there, every other gradient over DP x CP. With ``EP = 1`` each rank is its own EP group and
the expert DP groups are the DP x CP groups. ``EP`` must divide ``DP``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["ParallelLayout", "RankCoordinates"]


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (bools refused), else a ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class RankCoordinates(NamedTuple):
    """Position of one global rank on the ``[PP, DP, CP, TP]`` mesh (``cp`` last, so that
    ``RankCoordinates(pp, dp, tp)`` still means CP rank 0)."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How ``world_size`` ranks split into tensor, pipeline and data parallel groups."""

    world_size: int
    """Number of processes in the job (``torch.distributed`` world size)."""
    tensor_parallel_size: int = 1
    """Ranks that shard each layer's weights (TP, innermost, consecutive ranks)."""
    pipeline_parallel_size: int = 1
    """Ranks that hold consecutive slices of the layer stack (PP, outermost)."""
    context_parallel_size: int = 1
    """Ranks that split each sequence (CP), between DP and TP in the rank order."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of MoE layers (EP): consecutive DP ranks; divides DP."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel_size", "pipeline_parallel_size"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("context_parallel_size", self.context_parallel_size)
        check_positive_int("expert_model_parallel_size", self.expert_model_parallel_size)
        product = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size % (product * self.context_parallel_size) != 0:
            cp = ""
            if self.context_parallel_size != 1:
                cp = f" x context_parallel_size({self.context_parallel_size})"
                product *= self.context_parallel_size
            raise ValueError(
                f"tensor_parallel_size({self.tensor_parallel_size}) x "
                f"pipeline_parallel_size({self.pipeline_parallel_size}){cp} = {product} "
                f"does not divide world_size({self.world_size}); choose degrees whose product "
                f"divides the number of processes"
            )
        ep, dp = self.expert_model_parallel_size, self.data_parallel_size
        if dp % ep != 0:
            raise ValueError(
                f"expert_model_parallel_size({ep}) does not divide data_parallel_size({dp}) "
                f"(world_size({self.world_size}) / (tensor_parallel_size x "
                f"pipeline_parallel_size x context_parallel_size)): EP groups are carved out "
                f"of data parallelism"
            )

    @property
    def data_parallel_size(self) -> int:
        """DP = world / (TP * PP * CP)."""
        return self.world_size // (
            self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
        )

    @property
    def data_context_parallel_size(self) -> int:
        """DP * CP: the ranks over which gradients are averaged and ZeRO-1 shards state."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """TP * PP: the ranks that together hold one replica of the model."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coordinates(self, rank: int) -> RankCoordinates:
        """``(pp, dp, tp, cp)`` of a global rank."""
        self._check_rank(rank)
        tp, cp, dp = self.tensor_parallel_size, self.context_parallel_size, self.data_parallel_size
        return RankCoordinates(
            pp=rank // (dp * cp * tp),
            dp=(rank // (cp * tp)) % dp,
            tp=rank % tp,
            cp=(rank // tp) % cp,
        )

    def rank_of(self, *, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """Global rank at mesh position ``(pp, dp, cp, tp)``."""
        for name, value, size in (
            ("pp", pp, self.pipeline_parallel_size),
            ("dp", dp, self.data_parallel_size),
            ("cp", cp, self.context_parallel_size),
            ("tp", tp, self.tensor_parallel_size),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} is outside [0, {size})")
        return (
            (pp * self.data_parallel_size + dp) * self.context_parallel_size + cp
        ) * self.tensor_parallel_size + tp

    def _groups(self, vary: str) -> list[list[int]]:
        """Ranks that differ only in the coordinates named in ``vary`` (a string of ``p``,
        ``d``, ``c``, ``t``), grouped in rank order; groups ordered by their first rank."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            key = tuple(
                v
                for name, v in (("p", c.pp), ("d", c.dp), ("c", c.cp), ("t", c.tp))
                if name not in vary
            )
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values())

    def tensor_parallel_groups(self) -> list[list[int]]:
        """Every TP group: ranks that differ only in ``tp``."""
        return self._groups("t")

    def data_parallel_groups(self) -> list[list[int]]:
        """Every DP group: ranks that differ only in ``dp`` (they see different batches)."""
        return self._groups("d")

    def context_parallel_groups(self) -> list[list[int]]:
        """Every CP group: ranks that differ only in ``cp`` (slices of one sequence), in CP-rank
        order; with CP = 1, each rank alone."""
        return self._groups("c")

    def data_context_parallel_groups(self) -> list[list[int]]:
        """Every DP x CP group: ranks that differ only in ``dp`` and ``cp``, the replicas of one
        TP/PP slice of the model. Gradients are averaged and ZeRO-1 state is sharded over
        these (Megatron's ``with_context_parallel=True``); with CP = 1, the DP groups."""
        return self._groups("dc")

    def pipeline_parallel_groups(self) -> list[list[int]]:
        """Every PP group: ranks that differ only in ``pp``, in stage order."""
        return self._groups("p")

    def model_parallel_groups(self) -> list[list[int]]:
        """Every model-parallel (TP x PP) group: ranks that share ``dp`` and ``cp``."""
        return self._groups("pt")

    def context_parallel_src_tgt_pairs(self) -> list[list[int]]:
        """NxD's ``[src, tgt]`` ring pairs of every CP group: CP rank ``i`` sends to
        ``(i + 1) mod CP`` (the ``pairs`` of a collective permute that moves K/V one step
        around the ring), every group's pairs in group order; empty when CP = 1."""
        if self.context_parallel_size == 1:
            return []
        return [
            [group[i], group[(i + 1) % len(group)]]
            for group in self.context_parallel_groups()
            for i in range(len(group))
        ]

    @property
    def expert_data_parallel_size(self) -> int:
        """DP / EP * CP: the ranks holding the same experts (they average expert gradients)."""
        return self.data_context_parallel_size // self.expert_model_parallel_size

    def expert_model_parallel_rank(self, rank: int) -> int:
        """Position of ``rank`` in its EP group: ``dp mod EP`` (which slice of experts)."""
        return self.coordinates(rank).dp % self.expert_model_parallel_size

    def expert_data_parallel_rank(self, rank: int) -> int:
        """Position of ``rank`` in its expert DP group: ``(dp // EP) * CP + cp``."""
        c = self.coordinates(rank)
        return (c.dp // self.expert_model_parallel_size) * self.context_parallel_size + c.cp

    def _expert_groups(self, key_of: str) -> list[list[int]]:
        """Group ranks by ``(pp, tp, cp, dp // EP)`` (``key_of="ep"``: the EP groups) or by
        ``(pp, tp, dp mod EP)`` (``key_of="edp"``: the expert DP groups), in rank order."""
        ep = self.expert_model_parallel_size
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            if key_of == "ep":
                key: tuple[int, ...] = (c.pp, c.tp, c.cp, c.dp // ep)
            else:
                key = (c.pp, c.tp, c.dp % ep)
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values())

    def expert_model_parallel_groups(self) -> list[list[int]]:
        """Every EP group: ``EP`` consecutive DP ranks of one ``(pp, cp, tp)`` position, in EP-rank
        order (the ranks a MoE layer's all-to-all spans); with EP = 1, each rank alone."""
        return self._expert_groups("ep")

    def expert_data_parallel_groups(self) -> list[list[int]]:
        """Every expert DP group: the ranks holding the same experts (same ``pp``, ``tp`` and EP
        rank), which average those experts' gradients; with EP = 1, the DP x CP groups."""
        return self._expert_groups("edp")

    def kv_shared_groups(
        self, kv_shared_group_size: int, *, sequential_ranks_in_group: bool = False
    ) -> list[list[int]]:
        """NxD's KV-shared groups: inside each TP group ``g`` (``t = len(g)`` ranks), the
        ``m = kv_shared_group_size`` ranks that hold replicas of the same KV heads.

        Interleaved (NxD's default): ``[g[j], g[j + t/m], g[j + 2t/m], ...]`` for
        ``j < t/m``, matching K/V weights replicated block-wise (``[k_0 .. k_{h-1}]``
        repeated ``m`` times, then split over the ranks). With ``sequential_ranks_in_group``:
        runs of ``m`` adjacent ranks ``g[m*k : m*(k+1)]``, matching heads replicated one by
        one (``[k_0, k_0, ..., k_1, k_1, ...]``, one KV head per rank).
        """
        size = check_positive_int("kv_shared_group_size", kv_shared_group_size)
        tp = self.tensor_parallel_size
        if tp % size != 0:
            raise ValueError(
                f"kv_shared_group_size({size}) does not divide tensor_parallel_size({tp}): the "
                f"ranks sharing a KV head must come from one TP group"
            )
        stride = tp // size
        groups: list[list[int]] = []
        for tp_group in self.tensor_parallel_groups():
            if sequential_ranks_in_group:
                groups += [tp_group[k * size : (k + 1) * size] for k in range(stride)]
            else:
                groups += [tp_group[j::stride] for j in range(stride)]
        return groups

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size({self.world_size}))")
