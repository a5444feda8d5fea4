"""Per-rank timeline of a pipeline step: when each action ran, compute vs idle time."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ActionTiming", "Timeline"]


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
