"""Check a schedule without processes: coverage, local order, p2p pairing, deadlock-free run.

:func:`dry_run` executes the action lists with the runtime's semantics: consecutive
communication actions of a rank form one batch (posted together, as the runtime does with
``batch_send_recv``), a batch completes only when every peer has posted the matching operation
(synchronous sends, the strictest model; schedules built with ``asynchronous_sends`` are run
with sends that never wait), and a compute action waits for its input. Compute takes unit
time (F = 1, B = 2, I = W = 1: :attr:`ActionKind.unit_cost`, the generator's cost model), so
the dry run is also a timeline: :func:`format_grid` prints it as one row per rank and one column
per time step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nxd_pipeline._actions import Action, ActionKind, stage_to_rank

if TYPE_CHECKING:  # annotations only: a schedule prints itself through format_grid
    from nxd_pipeline._schedules import PipelineSchedule

__all__ = ["DryRun", "ScheduleError", "dry_run", "format_grid", "validate_schedule"]

F, B, BI, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order, mispaired or deadlocks."""


@dataclass
class DryRun:
    """The simulated execution: ``spans[r]`` is (start, end, action) for rank r's compute."""

    schedule: PipelineSchedule
    spans: list[list[tuple[int, int, Action]]] = field(default_factory=list)
    stuck: dict[int, Action] = field(default_factory=dict)
    """Rank -> the action it could not run (empty when the run completed)."""
    makespan: int = 0

    def bubble_fraction(self) -> float:
        """Idle share of ``p × makespan`` rank-time under unit costs."""
        busy = sum(end - start for rank in self.spans for start, end, _ in rank)
        total = self.schedule.num_ranks * self.makespan
        return 1.0 - busy / total if total else 0.0


def _peer_action(action: Action, p: int) -> tuple[int, Action]:
    """The rank and action at the other end of a send/recv."""
    s, mb = action.stage, action.microbatch
    other = {
        ActionKind.SEND_F: (s + 1, ActionKind.RECV_F),
        ActionKind.RECV_F: (s - 1, ActionKind.SEND_F),
        ActionKind.SEND_B: (s - 1, ActionKind.RECV_B),
        ActionKind.RECV_B: (s + 1, ActionKind.SEND_B),
    }[action.kind]
    return stage_to_rank(other[0], p), Action(other[0], other[1], mb)


def validate_schedule(schedule: PipelineSchedule) -> None:
    """Raise :class:`ScheduleError` unless the schedule is complete, ordered and deadlock-free.

    Checks: every action runs on the rank owning its stage; each stage runs each microbatch's
    forward once and its backward once (B, or I then W); on each rank F precedes the backward
    and receives precede the compute they feed; sends and receives pair up in the same order on
    both ends of every link; and :func:`dry_run` completes.
    """
    p, m, n_stages = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    if len(schedule.actions) != p:
        raise ScheduleError(f"schedule has {len(schedule.actions)} rank lists, expected p={p}")
    for rank, actions in enumerate(schedule.actions):
        counts = Counter((a.kind, a.stage, a.microbatch) for a in actions)
        position = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(actions)}
        for (kind, stage, microbatch), count in counts.items():
            if count > 1:
                raise ScheduleError(
                    f"rank {rank}: {Action(stage, kind, microbatch)} appears {count} times"
                )
        for action in actions:
            if stage_to_rank(action.stage, p) != rank or not 0 <= action.stage < n_stages:
                raise ScheduleError(f"rank {rank} runs {action}, whose stage is not on it")
            if not 0 <= action.microbatch < m:
                raise ScheduleError(f"rank {rank}: {action} names a microbatch outside [0, {m})")
        for stage in schedule.stages_of_rank(rank):
            for mb in range(m):
                _check_stage_microbatch(rank, stage, mb, counts, position, n_stages, p)
    _check_pairing(schedule)
    result = dry_run(schedule)
    if result.stuck:
        raise ScheduleError(
            "schedule deadlocks: "
            + ", ".join(f"rank {r} waits at {a}" for r, a in sorted(result.stuck.items()))
            + "\n"
            + format_grid(schedule, result)
        )


def _check_stage_microbatch(
    rank: int,
    stage: int,
    mb: int,
    counts: Counter,
    position: dict,
    n_stages: int,
    p: int,
) -> None:
    def where(kind: ActionKind) -> int | None:
        return position.get((kind, stage, mb))

    name = f"rank {rank}, stage {stage}, microbatch {mb}"
    if where(F) is None:
        raise ScheduleError(f"{name}: no forward {Action(stage, F, mb)}")
    split = where(BI) is not None or where(W) is not None
    if split and (where(BI) is None or where(W) is None or where(B) is not None):
        raise ScheduleError(f"{name}: a split backward needs exactly one I and one W and no B")
    if not split and where(B) is None:
        raise ScheduleError(f"{name}: no backward {Action(stage, B, mb)}")
    grad = where(BI) if split else where(B)
    forward = where(F)
    assert grad is not None
    assert forward is not None
    if grad < forward:
        raise ScheduleError(f"{name}: backward runs before its forward")
    if split and where(W) < grad:  # type: ignore[operator]
        raise ScheduleError(f"{name}: weight gradient {Action(stage, W, mb)} before its I")
    remote_prev = stage > 0 and stage_to_rank(stage - 1, p) != rank
    remote_next = stage < n_stages - 1 and stage_to_rank(stage + 1, p) != rank
    needs = []
    if remote_prev:
        needs += [(ActionKind.RECV_F, F, True), (ActionKind.SEND_B, BI if split else B, False)]
    if remote_next:
        needs += [(ActionKind.SEND_F, F, False), (ActionKind.RECV_B, BI if split else B, True)]
    for comm, compute, before in needs:
        at = where(comm)
        if at is None:
            raise ScheduleError(f"{name}: missing {Action(stage, comm, mb)}")
        if before != (at < where(compute)):  # type: ignore[operator]
            side = "before" if before else "after"
            raise ScheduleError(
                f"{name}: {Action(stage, comm, mb)} must come {side} {Action(stage, compute, mb)}"
            )


def _check_pairing(schedule: PipelineSchedule) -> None:
    """Sends from a to b must be received by b in the order a sent them (untagged p2p)."""
    p = schedule.num_ranks
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                peer, match = _peer_action(action, p)
                sent.setdefault((rank, peer), []).append(match)
            elif action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                peer, _ = _peer_action(action, p)
                received.setdefault((peer, rank), []).append(action)
    for link in sorted(set(sent) | set(received)):
        if sent.get(link, []) != received.get(link, []):
            raise ScheduleError(
                f"link rank {link[0]} -> rank {link[1]}: receives "
                f"{[str(a) for a in received.get(link, [])]} do not match the sends "
                f"{[str(a) for a in sent.get(link, [])]} in order"
            )


def dry_run(schedule: PipelineSchedule, *, asynchronous_sends: bool | None = None) -> DryRun:
    """Execute the schedule without processes; ``stuck`` is non-empty if it deadlocks.

    ``asynchronous_sends`` (default: the schedule's own setting) models a runtime whose sends
    never wait for the receiver (gloo here): a send completes once its data exists, a receive
    once its send was posted. Otherwise sends are synchronous, the strictest model.
    """
    if asynchronous_sends is None:
        asynchronous_sends = schedule.asynchronous_sends
    return _Simulation(schedule, asynchronous_sends).run()


class _Simulation:
    """One dry run's state: each rank's position and busy time, and what completed when."""

    def __init__(self, schedule: PipelineSchedule, asynchronous_sends: bool) -> None:
        self.asynchronous_sends = asynchronous_sends
        self.p, self.n_stages = schedule.num_ranks, schedule.num_stages
        self.actions = schedule.actions
        self.pointer = [0] * self.p
        self.busy_until = [0] * self.p
        self.done: set[tuple[int, Action]] = set()  # (rank, action) completed, comm included
        self.sent: set[tuple[int, Action]] = set()  # asynchronous sends posted
        self.finish: dict[tuple[int, Action], int] = {}
        self.result = DryRun(schedule=schedule, spans=[[] for _ in range(self.p)])
        self.time = 0

    def run(self) -> DryRun:
        while any(self.pointer[r] < len(self.actions[r]) for r in range(self.p)):
            self._settle_communication()
            self._start_computes()
            if self._deadlocked():
                self.result.stuck = {
                    r: self.actions[r][self.pointer[r]]
                    for r in range(self.p)
                    if self.pointer[r] < len(self.actions[r])
                }
                self.result.makespan = self.time
                return self.result
            self.time += 1
        self.result.makespan = max(self.busy_until, default=0)
        return self.result

    def _have(self, rank: int, action: Action) -> bool:
        """``action`` finished on ``rank`` by now."""
        return self.finish.get((rank, action), self.time + 1) <= self.time

    def _batch(self, rank: int) -> list[Action]:
        """The consecutive communication actions at the rank's position (one batch)."""
        out, i = [], self.pointer[rank]
        while i < len(self.actions[rank]) and self.actions[rank][i].kind.is_comm:
            out.append(self.actions[rank][i])
            i += 1
        return out

    def _inputs_ready(self, rank: int, action: Action) -> bool:
        s, mb, kind, p = action.stage, action.microbatch, action.kind, self.p
        if kind is F:
            if s == 0:
                return True
            if stage_to_rank(s - 1, p) != rank:
                return (rank, Action(s, ActionKind.RECV_F, mb)) in self.done
            return self._have(rank, Action(s - 1, F, mb))
        if kind is W:
            return self._have(rank, Action(s, BI, mb))
        if not self._have(rank, Action(s, F, mb)):
            return False
        if s == self.n_stages - 1:
            return True
        if stage_to_rank(s + 1, p) != rank:
            return (rank, Action(s, ActionKind.RECV_B, mb)) in self.done
        return self._have(rank, Action(s + 1, kind, mb))

    def _has_data(self, rank: int, op: Action) -> bool:
        """A send can only be posted once the compute producing its data has finished."""
        if op.kind is ActionKind.SEND_F:
            return self._have(rank, Action(op.stage, F, op.microbatch))
        if op.kind is ActionKind.SEND_B:
            return any(self._have(rank, Action(op.stage, kind, op.microbatch)) for kind in (B, BI))
        return True

    def _completes(self, rank: int, op: Action, posted: dict[int, list[Action]]) -> bool:
        """Whether ``op`` (posted by ``rank``) completes now; records asynchronous sends."""
        peer, match = _peer_action(op, self.p)
        if op.kind in (ActionKind.SEND_F, ActionKind.SEND_B) and self.asynchronous_sends:
            if self._has_data(rank, op):  # posted and done: the receiver picks it up
                self.sent.add((rank, op))
                return True
            return False
        if self.asynchronous_sends:
            return (peer, match) in self.sent
        return (
            match in posted.get(peer, [])
            and self._has_data(rank, op)
            and self._has_data(peer, match)
        )

    def _settle_communication(self) -> None:
        """Communication is instantaneous: complete every batch that can at this time step."""
        changed = True
        while changed:
            changed = False
            posted = {r: self._batch(r) for r in range(self.p) if self.busy_until[r] <= self.time}
            for rank, ops in posted.items():
                if not ops:
                    continue
                before = len(self.done)
                for op in ops:
                    if self._completes(rank, op, posted):
                        self.done.add((rank, op))
                if all((rank, op) in self.done for op in ops):
                    self.pointer[rank] += len(ops)
                    changed = True
                elif len(self.done) > before:  # a send went out: peers may now complete
                    changed = True

    def _next_compute_ready(self, rank: int) -> Action | None:
        """The rank's next action if it is a compute whose inputs are there."""
        if self.busy_until[rank] > self.time or self.pointer[rank] >= len(self.actions[rank]):
            return None
        action = self.actions[rank][self.pointer[rank]]
        return action if action.kind.is_compute and self._inputs_ready(rank, action) else None

    def _start_computes(self) -> None:
        for rank in range(self.p):
            action = self._next_compute_ready(rank)
            if action is None:
                continue
            end = self.time + action.kind.unit_cost
            self.result.spans[rank].append((self.time, end, action))
            self.finish[(rank, action)] = end
            self.done.add((rank, action))
            self.busy_until[rank] = end
            self.pointer[rank] += 1

    def _deadlocked(self) -> bool:
        """Nobody is computing, nobody can start anything, and work is left."""
        if any(busy > self.time for busy in self.busy_until):
            return False
        if any(self._next_compute_ready(r) is not None for r in range(self.p)):
            return False
        return any(self.pointer[r] < len(self.actions[r]) for r in range(self.p))


def format_grid(schedule: PipelineSchedule, run: DryRun | None = None) -> str:
    """One row per rank, one column per unit time step; ``.`` is idle, ``!`` marks a stall.

    A two-unit backward fills two columns. On a deadlock the row of each stuck rank ends with
    ``!<action>``: the step it could not take.
    """
    run = run if run is not None else dry_run(schedule)
    width = max(
        (len(str(a)) for rank in schedule.actions for a in rank if a.kind.is_compute), default=3
    )
    header = f"{schedule.name} p={schedule.num_ranks} m={schedule.num_microbatches} " + (
        f"v={schedule.virtual_pipeline_size}"
    )
    lines = [header]
    for rank in range(schedule.num_ranks):
        cells = ["."] * run.makespan
        for start, end, action in run.spans[rank]:
            for t in range(start, min(end, run.makespan)):
                cells[t] = str(action)
        row = " ".join(cell.rjust(width) for cell in cells)
        if rank in run.stuck:
            row = f"{row} !{run.stuck[rank]}".lstrip()
        lines.append(f"rank {rank}: {row}".rstrip())
    return "\n".join(lines)
