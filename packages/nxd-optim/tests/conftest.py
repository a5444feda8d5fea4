"""Warm the rank forkserver: creating a torch optimizer imports torch._dynamo (seconds)."""

import pytest

from nxd_state.testing import add_preload, pin_cpu_test

add_preload("torch._dynamo", "nxd_optim")


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
