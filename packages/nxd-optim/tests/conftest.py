"""Warm the rank forkserver: creating a torch optimizer imports torch._dynamo (seconds).

The ``slow`` marker: heavier variants (more ranks), run with ``-m slow``.
"""

import pytest

from nxd_state.testing import SLOW_MARKER, add_preload, pin_cpu_test, skip_slow_unless_selected

add_preload("torch._dynamo", "nxd_optim")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
