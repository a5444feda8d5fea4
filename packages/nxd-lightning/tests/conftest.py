"""Forkserver preloads for the rank processes, and the ``slow`` marker: heavier variants that run
only when selected with ``-m slow``."""

import pytest

from nxd_state.testing import SLOW_MARKER, add_preload, pin_cpu_test, skip_slow_unless_selected

# Ranks start from a forkserver that imported these once (Lightning and transformers take
# seconds to import; torch._dynamo is imported by the first optimizer).
add_preload(
    "torch._dynamo",
    "lightning.pytorch",
    "nxd_trainer",
    "nxd_trainer.hf",
    "nxd_lightning",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
