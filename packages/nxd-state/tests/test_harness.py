"""The multi-rank harness itself: results, failures, dead ranks and timeouts."""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nxd_state.testing import (
    DistributedTimeoutError,
    RankDiedError,
    RemoteTraceback,
    load_sibling,
    run_distributed,
)


def rank_and_world(offset: int, *, scale: int = 1) -> tuple[int, int, int]:
    return dist.get_rank(), dist.get_world_size(), (dist.get_rank() + offset) * scale


def test_results_come_back_in_rank_order_with_args_and_kwargs() -> None:
    assert run_distributed(rank_and_world, 4, 10, scale=2) == [
        (0, 4, 20),
        (1, 4, 22),
        (2, 4, 24),
        (3, 4, 26),
    ]


def fail_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"bad value on purpose, rank {bad_rank}")
    dist.barrier()  # the healthy ranks block here; the harness must not wait for them forever
    return dist.get_rank()


def test_rank_exception_is_reraised_with_rank_and_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad value on purpose, rank 2") as info:
        run_distributed(fail_on_rank, 4, 2, timeout=60)
    assert time.monotonic() - start < 30  # stopped the blocked ranks instead of timing out
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "--- rank 2 of 4 ---" in str(info.value.__cause__)
    assert "in fail_on_rank" in str(info.value.__cause__)
    assert "(raised on rank 2 of 4)" in getattr(info.value, "__notes__", [])


def die_without_reporting() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_rank_that_dies_is_reported_not_waited_for() -> None:
    with pytest.raises(RankDiedError, match=r"rank 1 of 2 exited with code 3"):
        run_distributed(die_without_reporting, 2, timeout=60)


def sleep_in_rank(seconds: float) -> None:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    dist.barrier()


def test_timeout_reports_every_waiting_rank_stack() -> None:
    # 10 s: long enough for both ranks to start and reach the sleep on a loaded 2-core machine
    # (3 s was not, with other suites running), so the dumped stacks show where they wait.
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(sleep_in_rank, 2, 120.0, timeout=10)
    message = str(info.value)
    assert "ranks [0, 1] did not finish within 10s" in message
    assert "--- rank 0 ---" in message
    assert "--- rank 1 ---" in message
    assert "sleep_in_rank" in message  # the Python frames of the stuck ranks


def use_torch_threads() -> int:
    return torch.get_num_threads()


def test_ranks_run_single_threaded() -> None:
    assert run_distributed(use_torch_threads, 2) == [1, 1]


def device_seen_with_a_visible_gpu() -> tuple[str, str, str]:
    """On a rank: the device nxd would pick if a GPU were visible here (torch.cuda.is_available
    patched to True, the way a CUDA machine answers), and the rank's thread variable."""
    import nxd_state

    torch.cuda.is_available = lambda: True  # this rank's process only
    return nxd_state.resolve_device_type(), os.environ["NXD_DEVICE"], os.environ["OMP_NUM_THREADS"]


def test_ranks_run_on_the_cpu_when_a_gpu_or_xla_is_visible() -> None:
    # Without the pin the first would be "cuda" (a GPU is visible) and the second "xla"
    # (PJRT_DEVICE, torch-xla's switch, is set): a CPU test must not depend on the machine.
    assert run_distributed(device_seen_with_a_visible_gpu, 2) == [("cpu", "cpu", "1")] * 2
    on_xla_machine = run_distributed(device_seen_with_a_visible_gpu, 1, env={"PJRT_DEVICE": "CPU"})
    assert on_xla_machine == [("cpu", "cpu", "1")]
    # A test that wants another device asks for it.
    assert run_distributed(device_seen_with_a_visible_gpu, 1, env={"NXD_DEVICE": "cuda"}) == [
        ("cuda", "cuda", "1")
    ]


def test_local_functions_are_rejected_with_a_reason() -> None:
    def local() -> None:
        return None

    with pytest.raises(ValueError, match="needs a module-level function"):
        run_distributed(local, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_distributed(rank_and_world, 0, 0)


def draw() -> None:
    DRAWS.append(torch.rand(1).item())


def broken() -> None:
    raise ValueError("wrong on purpose")


DRAWS: list[float] = []


def test_named_checks_reseed_each_check_and_name_the_failure() -> None:
    DRAWS.clear()
    from nxd_state.testing import run_named_checks

    assert run_named_checks({"a": draw, "b": draw}, seed=7) == ["a", "b"]
    torch.manual_seed(7)
    first = torch.rand(1).item()
    torch.manual_seed(8)
    assert [first, torch.rand(1).item()] == DRAWS
    with pytest.raises(AssertionError, match=r"check 'bad' failed at tp=2: wrong on purpose"):
        run_named_checks({"ok": draw, "bad": broken}, context="tp=2")


def test_load_sibling_shares_one_module_that_ranks_can_run(tmp_path: Path) -> None:
    helper = tmp_path / "_helper.py"
    helper.write_text(
        "import torch.distributed as dist\n"
        "LOADS = []\n"
        "LOADS.append(1)\n"
        "def world() -> int:\n"
        "    return dist.get_world_size()\n"
    )
    first = load_sibling(tmp_path / "test_a.py", "_helper")
    second = load_sibling(str(tmp_path / "test_b.py"), "_helper")
    assert first is second  # one module for every test file that loads it
    assert first.LOADS == [1]  # executed once
    assert run_distributed(first.world, 2) == [2, 2]
    with pytest.raises(FileNotFoundError, match=r"no _absent\.py beside"):
        load_sibling(tmp_path / "test_a.py", "_absent")
