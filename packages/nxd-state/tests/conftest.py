"""Tests marked ``xla`` need torch-xla; they run in the ``xla`` nox session. Every other test is
a CPU test wherever it runs: it sees ``nxd_state.testing.cpu_test_environment()``
(``NXD_DEVICE=cpu``, one OpenMP thread), as the harness's ranks do; tests of the device choice
itself set or clear the variables they need."""

import importlib.util

import pytest

from nxd_state.testing import pin_cpu_test


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(reason="torch-xla is not installed here; run `nox -s xla`")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
