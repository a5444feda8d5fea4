"""Traffic counting for :mod:`nxd_state.collectives`: group names, and calls and bytes per op.

An opt-in :class:`CollectiveCounter` records, per ``(op, group name)``, the number of calls,
the payload bytes and the wire bytes each collective reports through :func:`record` (what
those two byte counts mean per op is documented in :mod:`nxd_state.collectives`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "CollectiveCounter",
    "OpStats",
    "count_collectives",
    "group_name",
    "group_rank",
    "group_size",
    "nbytes",
    "record",
    "register_group_name",
]

Group = ProcessGroup | None

# Names given to groups by whoever built them ("tp", "dp", ...), for the counter's keys.
_GROUP_NAMES: weakref.WeakKeyDictionary[ProcessGroup, str] = weakref.WeakKeyDictionary()


def register_group_name(group: ProcessGroup, name: str) -> None:
    """Name ``group`` in traffic reports (``ParallelState`` uses tp/dp/pp/mp/cp/ep/kv)."""
    _GROUP_NAMES[group] = name


def group_name(group: Group) -> str:
    """The registered name of ``group``, else ``ranks[...]``."""
    resolved = group if group is not None else dist.GroupMember.WORLD
    if resolved is not None and resolved in _GROUP_NAMES:
        return _GROUP_NAMES[resolved]
    if resolved is dist.GroupMember.WORLD:
        return "world"
    return f"ranks{dist.get_process_group_ranks(resolved)}"


def group_size(group: Group = None) -> int:
    return dist.get_world_size(group)


def group_rank(group: Group = None) -> int:
    return dist.get_rank(group)


# Traffic counting ------------------------------------------------------------------------
@dataclass
class OpStats:
    """Totals for one (op, group) pair."""

    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class CollectiveCounter:
    """Calls and bytes per ``(op, group name)``; filled while :func:`count_collectives` runs."""

    stats: dict[tuple[str, str], OpStats] = field(default_factory=dict)

    def record(self, op: str, group: Group, payload: int, wire: float) -> None:
        entry = self.stats.setdefault((op, group_name(group)), OpStats())
        entry.calls += 1
        entry.bytes += payload
        entry.wire_bytes += wire

    def total(self, *, op: str | None = None, group: str | None = None) -> OpStats:
        """Sum over the entries matching ``op`` and/or ``group`` name."""
        out = OpStats()
        for (entry_op, entry_group), entry in self.stats.items():
            if (op is None or op == entry_op) and (group is None or group == entry_group):
                out.calls += entry.calls
                out.bytes += entry.bytes
                out.wire_bytes += entry.wire_bytes
        return out

    def as_dict(self) -> dict[str, dict[str, float]]:
        """JSON-ready ``{"op@group": {"calls", "bytes", "wire_bytes"}}``."""
        return {
            f"{op}@{grp}": vars(stats).copy() for (op, grp), stats in sorted(self.stats.items())
        }

    def reset(self) -> None:
        self.stats.clear()


_COUNTERS: list[CollectiveCounter] = []


@contextlib.contextmanager
def count_collectives(counter: CollectiveCounter | None = None) -> Iterator[CollectiveCounter]:
    """Count every collective issued inside the block (nested counters all see them)."""
    counter = counter if counter is not None else CollectiveCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def record(op: str, group: Group, payload: int, wire: float) -> None:
    for counter in _COUNTERS:
        counter.record(op, group, payload, wire)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
