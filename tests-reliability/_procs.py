"""The process table from ``/proc``, for the checks that a killed job left nothing behind.

Not a test module: test files load it with ``nxd_state.testing.load_sibling``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    """One process's fields of ``/proc/<pid>/stat`` that the checks read."""

    parent: int
    session: int
    start: int
    """Start time in clock ticks: tells a reused pid apart."""
    state: str

    @property
    def live(self) -> bool:
        """Running or sleeping: not a zombie (dead, not yet reaped) or dead."""
        return self.state not in "ZX"


def process_table() -> dict[int, Proc]:
    """pid -> :class:`Proc` of every process (one that exits during the scan is left out)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        table[int(entry)] = Proc(
            parent=int(fields[1]), session=int(fields[3]), start=int(fields[19]), state=fields[0]
        )
    return table
