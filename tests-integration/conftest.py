"""Every integration test is a CPU test wherever it runs (a visible GPU must not move it); the
``slow`` marker: heavier variants (more ranks, two launchers, the example renditions) that run
only with ``nox -s integration -- -m slow``."""

import pytest

from nxd_state.testing import SLOW_MARKER, pin_cpu_test, skip_slow_unless_selected


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)
