"""Forkserver preloads for the rank processes, and the ``slow`` marker: heavier repetitions
(more kills, more rank-death scenarios) that run only with ``nox -s reliability -- -m slow``."""

import sys

import pytest

from nxd_state.testing import add_preload, load_sibling

# The shared training job, importable by the test modules as ``nxd_reliability_job`` (pytest's
# importlib mode puts no test folder on sys.path; rank processes load it by file).
sys.modules["nxd_reliability_job"] = load_sibling(__file__, "_job")

add_preload("torch._dynamo", "nxd_optim", "nxd_trainer", "nxd_ckpt")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: heavier repetitions; selected with -m slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="heavier repetition: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
