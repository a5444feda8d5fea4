"""Every integration test is a CPU test wherever it runs (a visible GPU must not move it); the
``slow`` marker: heavier example renditions that run only with ``nox -s integration -- -m slow``."""

import pytest

from nxd_state.testing import pin_cpu_test


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: heavier example renditions; selected with -m slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="heavier example rendition: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)
