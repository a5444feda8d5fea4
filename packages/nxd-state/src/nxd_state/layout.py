"""Rank layout: pure arithmetic on the ``[PP, DP, TP]`` mesh, no communication.

Global ranks are laid out row-major over ``(pp, dp, tp)`` with TP innermost::

    rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank

so a tensor-parallel group is a run of ``TP`` consecutive ranks (the ranks that talk most
share a node), a data-parallel group strides by ``TP`` and a pipeline group by ``DP * TP``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["ParallelLayout", "RankCoordinates"]


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

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
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

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size({self.world_size}))")
