"""The rank processes and the trace workers fork from one forkserver: have it import the
export machinery (torch._dynamo, seconds) and the trace worker once, for all of them.

These are CPU tests, wherever they run: every test sees ``nxd_state.testing.
cpu_test_environment()``: ``NXD_DEVICE=cpu`` (a visible GPU must not move a trace to CUDA; the
harness's ranks are pinned the same way) and ``OMP_NUM_THREADS=1``, which the trace workers and
any fresh process take as their thread count, the harness's ranks' one thread: results compared
bit for bit with the ranks' must not depend on how many cores the machine has.

The ``slow`` marker: heavier variants (more ranks), run with ``-m slow``.
"""

import pytest

from nxd_state.testing import (
    SLOW_MARKER,
    add_preload,
    pin_cpu_test,
    skip_slow_unless_selected,
)

add_preload("torch.export", "torch._dynamo", "nxd_layers.trace._worker")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
