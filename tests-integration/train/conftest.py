"""The ``slow`` marker of the nxd-train suite: heavier variants (4 ranks, two launchers) run
only when selected with ``-m slow``, as in the packages' suites."""

import pytest

from nxd_state.testing import SLOW_MARKER, skip_slow_unless_selected


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)
