"""Forkserver preloads for the rank processes, and the ``slow`` marker: long variants (many
SIGKILL rounds) that run only when selected with ``-m slow``."""

from __future__ import annotations

import pytest

from nxd_state.testing import SLOW_MARKER, add_preload, skip_slow_unless_selected

add_preload("torch._dynamo", "nxd_optim", "nxd_pipeline.testing", "nxd_ckpt", "nxd_ckpt.testing")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)
