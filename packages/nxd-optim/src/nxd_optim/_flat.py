"""Flat, padded buckets: the layout ZeRO-1 shards.

The parameters p_1 … p_k of one param group are laid end to end in a flat vector
F = [vec(p_1), …, vec(p_k), 0 … 0], zero-padded to a length L = n·S that the n ranks of the
sharding group divide; rank r owns F[r·S : (r+1)·S]. A parameter may straddle shards:
:meth:`FlatLayout.pieces` says which slice of which parameter lands where in a shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["FlatLayout", "ShardPiece"]


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``[param_start, param_start + numel)`` of ``vec(p_i)`` sit at
    ``[shard_start, shard_start + numel)`` of one shard."""

    param_index: int
    param_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of k tensors in a flat vector padded to ``num_shards · shard_numel`` elements."""

    shapes: tuple[torch.Size, ...]
    num_shards: int

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not self.shapes:
            raise ValueError("a flat layout needs at least one tensor, got none")

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor], num_shards: int) -> FlatLayout:
        return cls(shapes=tuple(t.shape for t in tensors), num_shards=num_shards)

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each tensor in the flat vector."""
        starts, total = [], 0
        for numel in self.numels:
            starts.append(total)
            total += numel
        return tuple(starts)

    @property
    def total_numel(self) -> int:
        """Elements of real data (without padding)."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """S = ceil(total / n): the elements each rank owns."""
        return -(-self.total_numel // self.num_shards)

    @property
    def padded_numel(self) -> int:
        """L = n · S."""
        return self.shard_numel * self.num_shards

    def flatten(
        self,
        tensors: Sequence[torch.Tensor | None],
        dtype: torch.dtype,
        device: torch.device,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """F = [vec(t_1), …, vec(t_k), 0 …] in ``dtype``; a ``None`` tensor contributes zeros.
        ``out``: a buffer of ``padded_numel`` elements to write F into instead of a new one."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"layout holds {len(self.shapes)} tensors, got {len(tensors)}")
        if out is not None and (out.shape != (self.padded_numel,) or out.dtype != dtype):
            raise ValueError(
                f"flatten: out is {out.dtype} of shape {tuple(out.shape)}, expected {dtype} of "
                f"shape ({self.padded_numel},)"
            )
        flat = torch.empty(self.padded_numel, dtype=dtype, device=device) if out is None else out
        for tensor, start, numel in zip(tensors, self.offsets, self.numels):
            if tensor is None:
                flat[start : start + numel].zero_()
            else:
                flat[start : start + numel].copy_(tensor.reshape(-1))
        flat[self.total_numel :].zero_()  # the padding (written once, not the whole buffer)
        return flat

    def unflatten_into(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """t_i <- F[offset_i : offset_i + numel_i] reshaped, cast to t_i's dtype, in place."""
        if flat.numel() < self.total_numel:
            raise ValueError(f"flat vector has {flat.numel()} elements, need {self.total_numel}")
        for tensor, start, numel in zip(tensors, self.offsets, self.numels):
            tensor.copy_(flat[start : start + numel].view(tensor.shape))

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """F[r·S : (r+1)·S] (a view)."""
        self._check_rank(rank)
        return flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]

    def pieces(self, rank: int) -> list[ShardPiece]:
        """The parameter slices that land in shard ``rank``, in flat order (padding excluded)."""
        self._check_rank(rank)
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        found = []
        for index, (start, numel) in enumerate(zip(self.offsets, self.numels)):
            begin, end = max(lo, start), min(hi, start + numel)
            if begin < end:
                found.append(ShardPiece(index, begin - start, begin - lo, end - begin))
        return found

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"shard rank {rank} is outside [0, {self.num_shards})")
