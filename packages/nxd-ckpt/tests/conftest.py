"""Forkserver preloads for the rank processes, and the ``slow`` marker: long variants (many
SIGKILL rounds) that run only when selected with ``-m slow``."""

from __future__ import annotations

import pytest

from nxd_state.testing import add_preload

add_preload("torch._dynamo", "nxd_optim", "nxd_pipeline.testing", "nxd_ckpt", "nxd_ckpt.testing")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long variants; selected with -m slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow variant: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
