"""Check a schedule without processes: coverage, local order, p2p pairing, deadlock-free run.

:func:`dry_run` executes the action lists with the runtime's semantics: consecutive
communication actions of a rank form one batch (posted together, as the runtime does with
``batch_send_recv``), a batch completes only when every peer has posted the matching operation
(synchronous sends, the strictest model; schedules built with ``asynchronous_sends`` are run
with sends that never wait), and a compute action waits for its input. Compute takes unit
time (F = 1, B = 2, I = W = 1), so the dry run is also a timeline: :func:`format_grid` prints
it as one row per rank and one column per time step.
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
_COST = {F: 1, B: 2, BI: 1, W: 1}


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


def dry_run(  # noqa: C901 - to split (#26)
    schedule: PipelineSchedule, *, asynchronous_sends: bool | None = None
) -> DryRun:
    """Execute the schedule without processes; ``stuck`` is non-empty if it deadlocks.

    ``asynchronous_sends`` (default: the schedule's own setting) models a runtime whose sends
    never wait for the receiver (gloo here): a send completes once its data exists, a receive
    once its send was posted. Otherwise sends are synchronous, the strictest model.
    """
    if asynchronous_sends is None:
        asynchronous_sends = schedule.asynchronous_sends
    p, n_stages = schedule.num_ranks, schedule.num_stages
    actions = schedule.actions
    pointer = [0] * p
    busy_until = [0] * p
    done: set[tuple[int, Action]] = set()  # (rank, action) completed, comm included
    sent: set[tuple[int, Action]] = set()  # asynchronous sends posted
    finish: dict[tuple[int, Action], int] = {}
    result = DryRun(schedule=schedule, spans=[[] for _ in range(p)])
    time = 0

    def batch(rank: int) -> list[Action]:
        out, i = [], pointer[rank]
        while i < len(actions[rank]) and actions[rank][i].kind.is_comm:
            out.append(actions[rank][i])
            i += 1
        return out

    def inputs_ready(rank: int, action: Action) -> bool:
        s, mb, kind = action.stage, action.microbatch, action.kind

        def have(r: int, a: Action) -> bool:
            return finish.get((r, a), time + 1) <= time

        if kind is F:
            if s == 0:
                return True
            if stage_to_rank(s - 1, p) != rank:
                return (rank, Action(s, ActionKind.RECV_F, mb)) in done
            return have(rank, Action(s - 1, F, mb))
        if kind is W:
            return have(rank, Action(s, BI, mb))
        if not have(rank, Action(s, F, mb)):
            return False
        if s == n_stages - 1:
            return True
        if stage_to_rank(s + 1, p) != rank:
            return (rank, Action(s, ActionKind.RECV_B, mb)) in done
        return have(rank, Action(s + 1, kind, mb))

    def has_data(rank: int, op: Action) -> bool:
        """A send can only be posted once the compute producing its data has finished."""
        if op.kind is ActionKind.SEND_F:
            return finish.get((rank, Action(op.stage, F, op.microbatch)), time + 1) <= time
        if op.kind is ActionKind.SEND_B:
            return any(
                finish.get((rank, Action(op.stage, kind, op.microbatch)), time + 1) <= time
                for kind in (B, BI)
            )
        return True

    while any(pointer[r] < len(actions[r]) for r in range(p)):
        changed = True
        while changed:  # communication is instantaneous: settle it at this time step
            changed = False
            posted = {r: batch(r) for r in range(p) if busy_until[r] <= time}
            for rank, ops in posted.items():
                if not ops:
                    continue
                before = len(done)
                for op in ops:
                    peer, match = _peer_action(op, p)
                    if op.kind in (ActionKind.SEND_F, ActionKind.SEND_B) and asynchronous_sends:
                        if has_data(rank, op):  # posted and done: the receiver picks it up
                            sent.add((rank, op))
                            done.add((rank, op))
                    elif asynchronous_sends:
                        if (peer, match) in sent:
                            done.add((rank, op))
                    elif (
                        match in posted.get(peer, [])
                        and has_data(rank, op)
                        and has_data(peer, match)
                    ):
                        done.add((rank, op))
                if all((rank, op) in done for op in ops):
                    pointer[rank] += len(ops)
                    changed = True
                elif len(done) > before:  # a send went out: peers may now complete
                    changed = True
        for rank in range(p):
            if busy_until[rank] > time or pointer[rank] >= len(actions[rank]):
                continue
            action = actions[rank][pointer[rank]]
            if action.kind.is_compute and inputs_ready(rank, action):
                end = time + _COST[action.kind]
                result.spans[rank].append((time, end, action))
                finish[(rank, action)] = end
                done.add((rank, action))
                busy_until[rank] = end
                pointer[rank] += 1
        if all(busy_until[r] <= time for r in range(p)) and not any(
            busy_until[r] > time for r in range(p)
        ):
            # nobody is computing: if nobody can start anything either, it is a deadlock
            can_move = False
            for rank in range(p):
                if pointer[rank] >= len(actions[rank]):
                    continue
                action = actions[rank][pointer[rank]]
                if action.kind.is_compute and inputs_ready(rank, action):
                    can_move = True
            if not can_move and any(pointer[r] < len(actions[r]) for r in range(p)):
                result.stuck = {
                    r: actions[r][pointer[r]] for r in range(p) if pointer[r] < len(actions[r])
                }
                result.makespan = time
                return result
        time += 1
    result.makespan = max((busy for busy in busy_until), default=0)
    return result


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
