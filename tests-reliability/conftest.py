"""Forkserver preloads for the rank processes, and the ``slow`` marker: heavier repetitions
(more kills, more rank-death scenarios) that run only with ``nox -s reliability -- -m slow``."""

import sys

import pytest

from nxd_state.testing import SLOW_MARKER, add_preload, load_sibling, skip_slow_unless_selected

# The shared training job, importable by the test modules as ``nxd_reliability_job`` (pytest's
# importlib mode puts no test folder on sys.path; rank processes load it by file).
sys.modules["nxd_reliability_job"] = load_sibling(__file__, "_job")

add_preload("torch._dynamo", "nxd_optim", "nxd_trainer", "nxd_ckpt")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)
