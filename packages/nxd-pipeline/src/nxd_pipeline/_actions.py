"""Pipeline actions: one unit of work of one stage on one microbatch, printable and parseable.

An action reads ``{stage}{kind}{microbatch}``: ``1F0`` is stage 1's forward of microbatch 0,
``2B3`` its full backward, ``2I3`` / ``2W3`` the input-gradient and weight-gradient halves of a
split (zero-bubble) backward, and ``0SEND_F1`` / ``1RECV_F1`` the transfer of microbatch 1's
activations from stage 0 to stage 1 (``SEND_B`` / ``RECV_B`` carry gradients back).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["Action", "ActionKind", "stage_to_rank"]


class ActionKind(enum.Enum):
    """What an action does; the value is its spelling in ``str(action)``."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def unit_cost(self) -> int:
        """The cost model every schedule is generated and dry-run under: F = 1, B = 2 (input
        and weight gradients, each about one forward's work), I = W = 1; transfers 0."""
        return _UNIT_COST.get(self, 0)


_COMPUTE = {
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
}
_UNIT_COST = {
    ActionKind.FORWARD: 1,
    ActionKind.BACKWARD: 2,
    ActionKind.BACKWARD_INPUT: 1,
    ActionKind.BACKWARD_WEIGHT: 1,
}
# Longest spellings first, so "SEND_F" is not read as something shorter.
_KINDS = sorted((kind.value for kind in ActionKind), key=len, reverse=True)
_PATTERN = re.compile(rf"^(\d+)({'|'.join(_KINDS)})(\d+)$")


@dataclass(frozen=True)
class Action:
    """``kind`` of ``stage`` (global stage index) on ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The inverse of ``str``: ``Action.parse("1F0") == Action(1, FORWARD, 0)``."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> with kind one "
                f"of {[kind.value for kind in ActionKind]}, e.g. '1F0' or '0SEND_F2'"
            )
        return cls(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


def stage_to_rank(stage: int, num_ranks: int) -> int:
    """Looped placement: stage ``s`` runs on pipeline rank ``s mod p``."""
    return stage % num_ranks
