"""Boxes: rectangular regions of an n-d tensor, and the arithmetic resharding needs.

A box is ``(offsets, shape)``: the elements ``x[o_0 : o_0 + s_0, …, o_{n-1} : o_{n-1} + s_{n-1}]``.
Every piece of a checkpointed tensor is a box of the global tensor; a rank that loads asks
for boxes and receives, for each, the intersections with the saved boxes:

    A ∩ B = (max(a_i, b_i), min(a_i + s_i, b_i + t_i) - max(a_i, b_i))  per dimension.

A contiguous range ``[start, end)`` of the row-major flattening of a tensor (what a ZeRO-1
shard holds of a parameter) is not a box, but it is a union of at most ``2n - 1`` boxes,
each of them contiguous in memory (:func:`flat_range_boxes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Box", "flat_range_boxes", "linear_index"]


@dataclass(frozen=True)
class Box:
    """``offsets`` and ``shape`` of a rectangular region (same length; 0-d: both empty)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")

    @classmethod
    def whole(cls, shape: tuple[int, ...] | list[int]) -> Box:
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when empty."""
        if other.ndim != self.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        offsets, shape = [], []
        for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape):
            lo, hi = max(a, b), min(a + s, b + t)
            if hi <= lo:
                return None
            offsets.append(lo)
            shape.append(hi - lo)
        return Box(tuple(offsets), tuple(shape))

    def relative_to(self, origin: Box) -> Box:
        """This box in the coordinates of ``origin`` (which must contain it)."""
        return Box(tuple(a - o for a, o in zip(self.offsets, origin.offsets)), self.shape)

    def shifted(self, delta: tuple[int, ...]) -> Box:
        return Box(tuple(a + d for a, d in zip(self.offsets, delta)), self.shape)

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + t <= a + s
            for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape)
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + s) for a, s in zip(self.offsets, self.shape))


def linear_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """Row-major position of the element at ``offsets`` in a tensor of ``shape``."""
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements ``[start, end)`` of the row-major flattening of ``shape``, as boxes in flat
    order: a partial leading row, whole rows, a partial trailing row (recursively), so each
    box is contiguous in memory and together they cover the range exactly once."""
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {total} elements")
    if start == end:
        return []
    if not shape:
        return [Box((), ())]
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    zeros = (0,) * len(inner_shape)
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(end, inner)
    if row0 == row1:  # inside one row
        return [_prepend(row0, box) for box in flat_range_boxes(inner_shape, col0, col1)]
    out = []
    if col0:
        out += [_prepend(row0, box) for box in flat_range_boxes(inner_shape, col0, inner)]
        row0 += 1
    if row1 > row0:
        out.append(Box((row0, *zeros), (row1 - row0, *inner_shape)))
    if col1:
        out += [_prepend(row1, box) for box in flat_range_boxes(inner_shape, 0, col1)]
    return out


def _prepend(row: int, box: Box) -> Box:
    return Box((row, *box.offsets), (1, *box.shape))
