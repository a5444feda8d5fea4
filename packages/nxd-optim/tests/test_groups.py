"""Process groups the optimizer needs from NxD's rank lists come from the parallel state.

A partition that is one of the state's families is the state's own group; any other is
created once by :meth:`nxd_state.ParallelState.group_for` (nxd's group timeout; see
``packages/nxd-state/tests/test_group_for.py``). Without a parallel state, rank lists are
refused: nothing else may create process groups.
"""

from __future__ import annotations

import pytest

from nxd_state.testing import run_distributed


def resolve_through_the_state() -> dict[str, object]:
    import torch.distributed as dist

    import nxd_state
    from nxd_optim import _groups

    with pytest.raises(RuntimeError, match=r"need an nxd_state parallel state"):
        _groups.resolve_group([[0, 3], [1, 2]], None, "sharding_groups")
    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)  # DP = 2
    family = _groups.resolve_group(state.layout.data_parallel_groups(), None, "sharding_groups")
    other = _groups.resolve_group([[0, 3], [1, 2]], None, "sharding_groups")
    again = _groups.resolve_group([[0, 3], [1, 2]], None, "grad_norm_groups")
    mine = next(g for g in ([0, 3], [1, 2]) if dist.get_rank() in g)
    return {
        "family_is_state_group": family is state.data_parallel_group,
        "other_ranks": dist.get_process_group_ranks(other) == mine,
        "created_once": other is again and other is state.group_for(mine),
    }


def test_rank_lists_resolve_through_the_parallel_state() -> None:
    for report in run_distributed(resolve_through_the_state, 4):
        assert report == {"family_is_state_group": True, "other_ranks": True, "created_once": True}
