"""Every integration test is a CPU test wherever it runs (a visible GPU must not move it)."""

import pytest

from nxd_state.testing import pin_cpu_test


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)
