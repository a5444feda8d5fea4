"""The ``slow`` marker of the nxd-train suite: heavier variants (4 ranks, two launchers) run
only when selected with ``-m slow``, as in the packages' suites."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: heavier variants; selected with -m slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow variant: run with -m slow")
    for item in items:
        if "slow" in item.keywords and "train" in item.path.parts:
            item.add_marker(skip)
