"""Forkserver preloads for the rank processes, and the ``slow`` marker (more kill rounds)."""

from __future__ import annotations

import pytest

from nxd_state.testing import add_preload

add_preload("torch._dynamo", "nxd_optim", "nxd_pipeline.testing", "nxd_ckpt", "nxd_ckpt.testing")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: long variants (many SIGKILL rounds); run with -m slow"
    )
