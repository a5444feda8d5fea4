"""Ranks fork from a forkserver that already imported the Llama model code (slow to import)."""

import pytest

from nxd_state.testing import add_preload, pin_cpu_test

add_preload("transformers.models.llama.modeling_llama", "nxd_pipeline.testing")


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
