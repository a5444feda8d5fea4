"""Where and how the trace workers run, whatever the machine shows: the trace's device holds in
every worker (a CPU trace on a machine with a GPU never touches the GPU's generator), and the
workers' thread count is the caller's ``OMP_NUM_THREADS``, else an equal share of its cores.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import nxd_state
from nxd_layers.trace import parallel_model_trace
from nxd_layers.trace._api import _worker_threads


class DeviceProbe(nn.Module):
    """Returns ``x * 0 + seen``: ``seen`` is 1 where the worker's nxd_state chose the CPU."""

    def __init__(self, seen: float) -> None:
        super().__init__()
        self.register_buffer("seen", torch.tensor(seen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0 + self.seen


def probe_on_a_gpu_machine() -> tuple[nn.Module, None]:
    """``func`` for the trace: make this worker look like a GPU machine, then ask nxd_state."""
    torch.cuda.is_available = lambda: True  # this worker process only
    on_cpu = nxd_state.resolve_device_type() == "cpu"
    tracker_on_cpu = nxd_state.get_rng_tracker().device_type == "cpu"
    return DeviceProbe(float(on_cpu and tracker_on_cpu)), None


def test_a_cpu_trace_stays_on_the_cpu_where_a_gpu_is_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The caller names the device; nothing in its environment does (without the workers' own
    # pin they would see the GPU and pick CUDA: the probe would return 0).
    monkeypatch.delenv("NXD_DEVICE")
    x = torch.ones(2, 3)
    with parallel_model_trace(
        probe_on_a_gpu_machine, x, tp_degree=1, device_type="cpu", _eager=True
    ) as model:
        torch.testing.assert_close(model(x), torch.ones(2, 3), rtol=0.0, atol=0.0)


def test_worker_threads_follow_omp_num_threads_else_share_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _worker_threads("cpu", 4) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert _worker_threads("cpu", 2) == max(1, (cores or 1) // 2)
    assert _worker_threads("cpu", 10_000) == 1
    assert _worker_threads("cuda", 1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS must be a positive integer, got 'zero'"):
        _worker_threads("cpu", 2)
