"""Rank layout: pure arithmetic on the ``[PP, DP, TP]`` mesh, no communication.

Global ranks are laid out row-major over ``(pp, dp, tp)`` with TP innermost::

    rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank

so a tensor-parallel group is a run of ``TP`` consecutive ranks (the ranks that talk most
share a node), a data-parallel group strides by ``TP`` and a pipeline group by ``DP * TP``.

NxD's other degrees are fixed at 1 here: context parallelism (CP) and expert parallelism (EP)
are not implemented, so every rank is its own CP and EP group and the expert data-parallel
groups are the DP groups (NxD's ``[PP, DP_exp, EP, TP]`` view with ``EP = 1``). A degree above
1 is refused when the layout is made, before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["ParallelLayout", "RankCoordinates"]

_UNSUPPORTED = {
    "context_parallel_size": (
        "context parallelism (CP > 1: the sequence split over ranks, with ring attention)",
        "sequence parallelism (sequence_parallel_enabled=True) shards activations along the "
        "sequence inside the TP group",
    ),
    "expert_model_parallel_size": (
        "expert parallelism (EP > 1: MoE experts split over ranks)",
        "experts of a MoE layer can be tensor-parallel like any other linear layer",
    ),
}


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (bools refused), else a ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_unsupported_degree(name: str, value: object) -> None:
    """Refuse a CP or EP degree other than 1 (``name`` is NxD's keyword)."""
    check_positive_int(name, value)
    if value != 1:
        what, instead = _UNSUPPORTED[name]
        raise NotImplementedError(
            f"{name}={value}: nxd does not support {what}; use {name}=1 ({instead})"
        )


class RankCoordinates(NamedTuple):
    """Position of one global rank on the ``[PP, DP, TP]`` mesh."""

    pp: int
    dp: int
    tp: int


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
    """Ranks that split each sequence (CP); only 1 is supported."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of MoE layers (EP); only 1 is supported."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel_size", "pipeline_parallel_size"):
            check_positive_int(name, getattr(self, name))
        check_unsupported_degree("context_parallel_size", self.context_parallel_size)
        check_unsupported_degree("expert_model_parallel_size", self.expert_model_parallel_size)
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size % model_parallel != 0:
            raise ValueError(
                f"tensor_parallel_size({self.tensor_parallel_size}) x "
                f"pipeline_parallel_size({self.pipeline_parallel_size}) = {model_parallel} "
                f"does not divide world_size({self.world_size}); choose degrees whose product "
                f"divides the number of processes"
            )

    @property
    def data_parallel_size(self) -> int:
        """DP = world / (TP * PP)."""
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    @property
    def model_parallel_size(self) -> int:
        """TP * PP: the ranks that together hold one replica of the model."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coordinates(self, rank: int) -> RankCoordinates:
        """``(pp, dp, tp)`` of a global rank."""
        self._check_rank(rank)
        tp = self.tensor_parallel_size
        dp = self.data_parallel_size
        return RankCoordinates(pp=rank // (dp * tp), dp=(rank // tp) % dp, tp=rank % tp)

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        """Global rank at mesh position ``(pp, dp, tp)``."""
        for name, value, size in (
            ("pp", pp, self.pipeline_parallel_size),
            ("dp", dp, self.data_parallel_size),
            ("tp", tp, self.tensor_parallel_size),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} is outside [0, {size})")
        return (pp * self.data_parallel_size + dp) * self.tensor_parallel_size + tp

    def tensor_parallel_groups(self) -> list[list[int]]:
        """Every TP group: ranks that differ only in ``tp``."""
        return [
            [self.rank_of(pp=p, dp=d, tp=t) for t in range(self.tensor_parallel_size)]
            for p in range(self.pipeline_parallel_size)
            for d in range(self.data_parallel_size)
        ]

    def data_parallel_groups(self) -> list[list[int]]:
        """Every DP group: ranks that differ only in ``dp``."""
        return [
            [self.rank_of(pp=p, dp=d, tp=t) for d in range(self.data_parallel_size)]
            for p in range(self.pipeline_parallel_size)
            for t in range(self.tensor_parallel_size)
        ]

    def pipeline_parallel_groups(self) -> list[list[int]]:
        """Every PP group: ranks that differ only in ``pp``, in stage order."""
        return [
            [self.rank_of(pp=p, dp=d, tp=t) for p in range(self.pipeline_parallel_size)]
            for d in range(self.data_parallel_size)
            for t in range(self.tensor_parallel_size)
        ]

    def model_parallel_groups(self) -> list[list[int]]:
        """Every model-parallel (TP x PP) group: ranks that share ``dp``."""
        return [
            [
                self.rank_of(pp=p, dp=d, tp=t)
                for p in range(self.pipeline_parallel_size)
                for t in range(self.tensor_parallel_size)
            ]
            for d in range(self.data_parallel_size)
        ]

    def context_parallel_groups(self) -> list[list[int]]:
        """Every CP group: with CP = 1, each rank alone."""
        return [[rank] for rank in range(self.world_size)]

    def expert_model_parallel_groups(self) -> list[list[int]]:
        """Every EP group: with EP = 1, each rank alone."""
        return [[rank] for rank in range(self.world_size)]

    def expert_data_parallel_groups(self) -> list[list[int]]:
        """Every expert DP group (ranks holding the same expert shard): with EP = 1, the DP
        groups."""
        return self.data_parallel_groups()

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
