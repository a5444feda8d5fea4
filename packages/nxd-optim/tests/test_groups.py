"""Process groups the optimizer creates from NxD's rank lists get nxd's group timeout.

torch's ``new_group`` does not inherit the default group's timeout; ParallelState passes
``nxd_state.health.group_timeout()`` to every group it builds, and so must the optimizer when
it builds groups from ``as_list`` rank lists that are not the parallel state's own.
"""

from __future__ import annotations

import datetime

from nxd_state.testing import run_distributed


def create_from_lists() -> list[float | None]:
    import torch.distributed as dist

    from nxd_optim import _groups
    from nxd_state import health

    health.set_group_timeout(datetime.timedelta(seconds=123))
    seen: list[float | None] = []
    real = dist.new_group

    def recording(*args: object, **kwargs: object) -> object:
        timeout = kwargs.get("timeout")
        seen.append(timeout.total_seconds() if timeout is not None else None)  # type: ignore[attr-defined]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    dist.new_group = recording  # type: ignore[assignment]
    try:
        group = _groups.resolve_group([[0], [1]], None, "sharding_groups")  # no parallel state
    finally:
        dist.new_group = real  # type: ignore[assignment]
    assert dist.get_process_group_ranks(group) == [dist.get_rank()]
    return seen


def test_groups_from_rank_lists_get_the_group_timeout() -> None:
    for seen in run_distributed(create_from_lists, 2):
        assert seen == [123.0, 123.0]  # one group per list, each with nxd's timeout
