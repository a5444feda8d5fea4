"""NxD's import path for parallel state resolves to nxd_state, under a real process group."""

import torch.distributed as dist

from nxd_state.testing import run_distributed


def nxd_script_view() -> tuple[int, int, int, list[list[int]]]:
    from neuronx_distributed import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
        dist.get_world_size(parallel_state.get_data_parallel_group()),
        parallel_state.get_tensor_model_parallel_group(as_list=True),
    )


def test_nxd_parallel_state_import_path() -> None:
    results = run_distributed(nxd_script_view, 4)
    assert results == [(r % 2, r // 2, 2, [[0, 1], [2, 3]]) for r in range(4)]
