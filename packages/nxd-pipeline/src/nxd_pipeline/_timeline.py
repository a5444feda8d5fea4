"""Per-rank timeline of a pipeline step: when each action ran, compute vs idle time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ActionTiming", "Timeline", "format_timeline"]


@dataclass(frozen=True)
class ActionTiming:
    """One executed action: its spelling (``1F0``), whether it computes, start/end seconds."""

    action: str
    compute: bool
    start: float
    end: float


@dataclass
class Timeline:
    """What one rank did during one ``run_train`` / ``run_eval`` (``perf_counter`` seconds)."""

    entries: list[ActionTiming] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def compute_s(self) -> float:
        return sum(e.end - e.start for e in self.entries if e.compute)

    @property
    def idle_s(self) -> float:
        """Wall time not spent computing: waiting on peers, transfers, bookkeeping."""
        return self.wall_s - self.compute_s

    def bubble_fraction(self) -> float:
        """``idle / wall`` on this rank."""
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "wall_s": self.wall_s,
            "compute_s": self.compute_s,
            "idle_s": self.idle_s,
            "bubble_fraction": self.bubble_fraction(),
            "actions": [
                (e.action, e.compute, e.start - self.start, e.end - self.start)
                for e in self.entries
            ],
        }


def format_timeline(
    timelines: Sequence[Timeline], *, slot_s: float | None = None, title: str = ""
) -> str:
    """:func:`nxd_pipeline.format_grid` with real times: one row per rank, one column per slot.

    Column ``j`` of rank r covers ``[j·slot, (j+1)·slot)`` seconds after that rank's own
    ``start`` (ranks start a step together, so the rows line up to within the step's launch
    skew). The cell names the compute action that fills most of the slot, ``.`` where the
    rank spent most of it not computing (waiting on a peer, communicating, bookkeeping).
    ``slot_s`` defaults to half the median compute action, so every action of at least
    that length shows. Each row ends with the rank's compute and wall time and idle share.
    """
    durations = sorted(e.end - e.start for t in timelines for e in t.entries if e.compute)
    if slot_s is None:
        slot_s = durations[len(durations) // 2] / 2 if durations else 1.0
    if slot_s <= 0:
        raise ValueError(f"slot_s must be positive, got {slot_s!r}")
    slots = max((math.ceil(t.wall_s / slot_s - 1e-9) for t in timelines), default=0)
    width = max((len(e.action) for t in timelines for e in t.entries if e.compute), default=3)
    lines = [f"{title} slot={slot_s * 1e3:.1f} ms".strip()]
    for rank, timeline in enumerate(timelines):
        cells = []
        for j in range(slots):
            low = timeline.start + j * slot_s
            high = low + slot_s
            overlap = {
                e.action: min(e.end, high) - max(e.start, low)
                for e in timeline.entries
                if e.compute and e.start < high and e.end > low
            }
            best = max(overlap, key=overlap.__getitem__, default=None)
            hit = best if best is not None and overlap[best] * 2 >= slot_s else "."
            cells.append(hit.rjust(width))
        summary = (
            f"| compute {timeline.compute_s * 1e3:.0f} ms of {timeline.wall_s * 1e3:.0f} ms, "
            f"idle {timeline.bubble_fraction():.3f}"
        )
        lines.append(f"rank {rank}: {' '.join(cells)} {summary}")
    return "\n".join(lines)
