"""Schedules as data, checked without processes: coverage, order, pairing, deadlocks, grid."""

from __future__ import annotations

import itertools

import pytest

from nxd_pipeline import (
    Action,
    ActionKind,
    ActionTiming,
    PipelineSchedule,
    ScheduleError,
    Timeline,
    build_schedule,
    dry_run,
    format_grid,
    format_timeline,
    stage_to_rank,
    validate_schedule,
)

F, B, BI, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)

CASES = [
    (name, p, m, v)
    for name, p, m, v in itertools.product(
        ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"], [2, 4], [1, 2, 4, 8], [1, 2]
    )
    if not (name in ("1f1b", "zb_h1") and v > 1)
]


@pytest.mark.parametrize("asynchronous_sends", [False, True])
@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_every_schedule_is_complete_ordered_and_deadlock_free(
    name: str, p: int, m: int, v: int, asynchronous_sends: bool
) -> None:
    schedule = build_schedule(name, p, m, v, asynchronous_sends=asynchronous_sends)
    validate_schedule(schedule)  # raises on any violation
    # Independently of validate_schedule: each stage runs each microbatch forward once and
    # backward once (B, or I + W) on the rank that owns it ...
    seen: dict[tuple[ActionKind, int, int], int] = {}
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            assert stage_to_rank(action.stage, p) == rank
            key = (action.kind, action.stage, action.microbatch)
            seen[key] = seen.get(key, 0) + 1
    split = name == "zb_h1"
    for stage, mb in itertools.product(range(p * v), range(m)):
        assert seen.get((F, stage, mb)) == 1
        if split:
            assert (
                seen.get((BI, stage, mb)),
                seen.get((W, stage, mb)),
                seen.get((B, stage, mb)),
            ) == (
                1,
                1,
                None,
            )
        else:
            assert seen.get((B, stage, mb)) == 1
    # ... and the simulated run respects every data dependency in time.
    run = dry_run(schedule)
    assert not run.stuck
    start = {a: s for rank in run.spans for s, _, a in rank}
    end = {a: e for rank in run.spans for _, e, a in rank}
    grad = BI if split else B
    for stage, mb in itertools.product(range(p * v), range(m)):
        if stage > 0:
            assert end[Action(stage - 1, F, mb)] <= start[Action(stage, F, mb)]
        assert end[Action(stage, F, mb)] <= start[Action(stage, grad, mb)]
        if stage < p * v - 1:
            assert end[Action(stage + 1, grad, mb)] <= start[Action(stage, grad, mb)]
        if split:
            assert end[Action(stage, BI, mb)] <= start[Action(stage, W, mb)]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 2)])
def test_1f1b_and_gpipe_bubble_match_theory_under_unit_costs(p: int, m: int) -> None:
    # F = 1, B = 2 unit costs: the idle share of p x makespan is exactly (p-1)/(m+p-1).
    for name in ("1f1b", "gpipe"):
        assert dry_run(build_schedule(name, p, m)).bubble_fraction() == pytest.approx(
            (p - 1) / (m + p - 1)
        )


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8)])
def test_interleaved_bubble_matches_theory_with_asynchronous_sends(p: int, m: int) -> None:
    # v = 2 chunks per rank shrink the bubble to (p-1)/(v·m+p-1) (m a multiple of p). With
    # synchronous sends a rank can also stall while its peer is mid-compute: never better.
    theory = (p - 1) / (2 * m + p - 1)
    relaxed = build_schedule("interleaved_1f1b", p, m, 2, asynchronous_sends=True)
    assert dry_run(relaxed).bubble_fraction() == pytest.approx(theory)
    strict = dry_run(build_schedule("interleaved_1f1b", p, m, 2)).bubble_fraction()
    assert strict >= theory - 1e-12


@pytest.mark.parametrize("asynchronous_sends", [False, True])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_zero_bubble_h1_bubble_is_optimal_and_activation_memory_1f1b(
    p: int, m: int, asynchronous_sends: bool
) -> None:
    # ZB-H1 moves W into the bubbles: with F = I = W = 1 every rank does 3m units of work and
    # the last one cannot start before p - 1, so the makespan is >= 3m + p - 1; rank 0 cannot
    # start I_0 before 2p - 1 (F through p stages, I back through p - 1) and still has m I and
    # m W after it, so also >= 2p + 2m - 1. The schedule reaches that bound exactly, in both
    # transfer layouts: for m >= p the bubble is the ZB-H1 theory (p-1)/(3m+p-1).
    schedule = build_schedule("zb_h1", p, m, asynchronous_sends=asynchronous_sends)
    run = dry_run(schedule)
    assert run.makespan == max(3 * m + p - 1, 2 * p + 2 * m - 1)
    if m >= p:
        assert run.bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert run.bubble_fraction() < dry_run(build_schedule("1f1b", p, m)).bubble_fraction()
    # A microbatch's activations live from its F to its W: never more than p at once on any
    # rank, 1F1B's peak (rank 0 holds p there); at most p - r await their I on rank r, as in
    # 1F1B.
    for rank, actions in enumerate(schedule.actions):
        in_flight = awaiting_i = peak = peak_i = 0
        for action in actions:
            in_flight += {F: 1, W: -1}.get(action.kind, 0)
            awaiting_i += {F: 1, BI: -1}.get(action.kind, 0)
            peak, peak_i = max(peak, in_flight), max(peak_i, awaiting_i)
        assert peak <= p
        assert peak_i <= p - rank


def test_zero_bubble_h1_grid_four_ranks() -> None:
    # The unit-cost timeline at p = 4, m = 8: each rank idles only before its first I
    # (p - 1 steps in all), the W lag of r on rank r fills the cool-down.
    assert format_grid(build_schedule("zb_h1", 4, 8)).splitlines()[1:] == [
        "rank 0: 0F0 0F1 0F2 0F3   .   .   . 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7"
        " 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
        "rank 1:   . 1F0 1F1 1F2   .   . 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3"
        " 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7",
        "rank 2:   .   . 2F0 2F1   . 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5"
        " 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7",
        "rank 3:   .   .   . 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6"
        " 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7",
    ]


def test_action_prints_and_parses_back() -> None:
    for text in ["1F0", "12B3", "0I7", "3W2", "0SEND_F1", "1RECV_F1", "2SEND_B0", "1RECV_B0"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("1F0") == Action(1, F, 0)
    with pytest.raises(ValueError, match=r"cannot parse action 'F1'.*<stage><kind><microbatch>"):
        Action.parse("F1")


def test_grid_of_1f1b_two_ranks_two_microbatches() -> None:
    grid = format_grid(build_schedule("1f1b", 2, 2))
    assert grid == (
        "1f1b p=2 m=2 v=1\n"
        "rank 0: 0F0 0F1   .   . 0B0 0B0   . 0B1 0B1\n"
        "rank 1:   . 1F0 1B0 1B0 1F1 1B1 1B1   .   ."
    )
    assert [str(a) for a in build_schedule("1f1b", 2, 2).actions[1]] == [
        "1RECV_F0",
        "1F0",
        "1RECV_F1",
        "1B0",
        "1SEND_B0",
        "1F1",
        "1B1",
        "1SEND_B1",
    ]


def _schedule(rank_lists: list[list[str]], m: int) -> PipelineSchedule:
    return PipelineSchedule(
        name="1f1b",
        num_ranks=len(rank_lists),
        num_microbatches=m,
        actions=[[Action.parse(t) for t in rank] for rank in rank_lists],
    )


RANK_0_FORWARD = ["2RECV_F0", "0F0", "0SEND_F0", "2F0", "2SEND_F0"]
RANK_1_FORWARD = ["1RECV_F0", "1F0", "1SEND_F0", "3RECV_F0", "3F0"]


def test_dry_run_finds_a_deadlock_and_the_grid_marks_it() -> None:
    # Two chunks per rank: rank 0 waits for stage 2's input before sending stage 0's output,
    # which stage 1 (rank 1) needs to produce it. Local order and link order are both fine.
    schedule = _schedule(
        [
            [*RANK_0_FORWARD, "2RECV_B0", "2B0", "2SEND_B0", "0RECV_B0", "0B0"],
            [*RANK_1_FORWARD, "3B0", "3SEND_B0", "1RECV_B0", "1B0", "1SEND_B0"],
        ],
        m=1,
    )
    schedule.virtual_pipeline_size = 2
    run = dry_run(schedule)
    assert run.stuck == {0: Action.parse("2RECV_F0"), 1: Action.parse("1RECV_F0")}
    grid = format_grid(schedule, run)
    assert grid.splitlines()[1:] == ["rank 0: !2RECV_F0", "rank 1: !1RECV_F0"]
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 waits at 2RECV_F0"):
        validate_schedule(schedule)
    # A send placed before the compute producing its data is reported too.
    early = _schedule(
        [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1SEND_B0", "1RECV_F0", "1F0", "1B0"]], m=1
    )
    with pytest.raises(ScheduleError, match=r"1SEND_B0 must come after 1B0"):
        validate_schedule(early)
    assert dry_run(early).stuck


def test_validation_rejects_missing_work_and_misordered_links() -> None:
    missing = _schedule([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0"]], m=1)
    with pytest.raises(ScheduleError, match=r"stage 1, microbatch 0: no backward 1B0"):
        validate_schedule(missing)
    swapped = _schedule(
        [
            ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
            ["1RECV_F1", "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"],
        ],
        m=2,
    )
    with pytest.raises(ScheduleError, match=r"link rank 0 -> rank 1: receives"):
        validate_schedule(swapped)


def test_bad_schedule_arguments_fail_early() -> None:
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match=r"'1f1b' runs one model chunk.*virtual_pipeline_size=2"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match=r"num_microbatches must be a positive int, got 0"):
        build_schedule("1f1b", 2, 0)
    assert build_schedule("Interleaved", 2, 4, 2).name == "interleaved_1f1b"


def test_timeline_grid_prints_real_times_per_slot() -> None:
    # Slot = half the median compute (1 s here): a cell names the compute filling most of
    # the slot; communication, waiting and a compute covering under half a slot show as idle.
    rank0 = Timeline(
        entries=[
            ActionTiming("0F0", True, 10.0, 12.0),
            ActionTiming("0SEND_F0", False, 12.0, 12.2),
            ActionTiming("0I0", True, 13.0, 15.0),
        ],
        start=10.0,
        end=15.0,
    )
    rank1 = Timeline(
        entries=[ActionTiming("1F0", True, 22.4, 24.4), ActionTiming("1I0", True, 24.4, 24.8)],
        start=20.0,
        end=25.0,
    )
    assert format_timeline([rank0, rank1], title="zb_h1").splitlines() == [
        "zb_h1 slot=1000.0 ms",
        "rank 0: 0F0 0F0   . 0I0 0I0 | compute 4000 ms of 5000 ms, idle 0.200",
        "rank 1:   .   . 1F0 1F0   . | compute 2400 ms of 5000 ms, idle 0.520",
    ]
    with pytest.raises(ValueError, match="slot_s must be positive, got 0"):
        format_timeline([rank0], slot_s=0)
