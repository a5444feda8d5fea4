"""``ParallelState.group_for``: the group of any rank list, created once per state with nxd's
group timeout (torch's ``new_group`` does not inherit the default group's), ``None`` outside it,
and released with the state."""

from __future__ import annotations

import datetime

from nxd_state.testing import run_distributed


def create_groups() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    import nxd_state
    from nxd_state import health

    health.set_group_timeout(datetime.timedelta(seconds=123))
    state = nxd_state.initialize_model_parallel()  # TP = 1: its groups already exist
    seen: list[float | None] = []
    real = dist.new_group

    def recording(*args: object, **kwargs: object) -> object:
        timeout = kwargs.get("timeout")
        seen.append(timeout.total_seconds() if timeout is not None else None)  # type: ignore[attr-defined]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    dist.new_group = recording  # type: ignore[assignment]
    try:
        zero = state.group_for([0])
        one = state.group_for([1])
        again = state.group_for([0])
        partition, ranks = state.partition_group([[1], [0]], "test groups")
    finally:
        dist.new_group = real  # type: ignore[assignment]
    mine = zero if dist.get_rank() == 0 else one
    assert mine is not None
    value = torch.ones(1)
    dist.all_reduce(value, group=mine)
    report = {
        "timeouts": seen,
        "member": (zero is not None, one is not None),
        "cached": again is zero,
        "partition": (partition is state.tensor_parallel_group, ranks),
        "sum": value.item(),
    }
    nxd_state.destroy_model_parallel()
    return report


def test_group_for_creates_each_rank_list_once_with_the_group_timeout() -> None:
    reports = run_distributed(create_groups, 2)
    for rank, report in enumerate(reports):
        assert report["timeouts"] == [123.0, 123.0]  # one group per list, each with nxd's timeout
        assert report["member"] == (rank == 0, rank == 1)
        assert report["cached"] is True
        assert report["partition"] == (True, [rank])  # the TP family: the state's own groups
        assert report["sum"] == 1.0  # a group of one
