"""nxd-state installed alone: a world of one, the [PP, DP, TP] layout, a collective on 2 ranks."""

import os

import torch
import torch.distributed as dist

import nxd_state
from nxd_state import collectives
from nxd_state.testing import run_distributed


def all_reduce_rank() -> float:
    """On each of 2 gloo ranks: the sum of (rank + 1) over the world."""
    value = torch.tensor([dist.get_rank() + 1.0])
    with nxd_state.count_collectives() as counter:
        collectives.all_reduce(value, group=dist.group.WORLD)
    assert counter.total(op="all_reduce").calls == 1, counter.as_dict()
    return value.item()


def main() -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)
    nxd_state.init_distributed(device_type="cpu")
    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
    assert (state.tensor_parallel_size, state.data_parallel_size) == (1, 1), state
    layout = nxd_state.ParallelLayout(
        world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2
    )
    assert layout.tensor_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    coords = layout.coordinates(5)
    assert (coords.pp, coords.dp, coords.cp, coords.tp) == (1, 0, 0, 1), coords
    nxd_state.destroy_model_parallel()
    dist.destroy_process_group()

    assert run_distributed(all_reduce_rank, 2) == [3.0, 3.0]
    print("nxd-state smoke: ok")


if __name__ == "__main__":
    main()
