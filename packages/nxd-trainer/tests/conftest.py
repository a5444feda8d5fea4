"""Forkserver preloads for the rank processes; the ``slow`` marker (heavier variants, run with
``-m slow``); the skip of ``xla`` tests without torch-xla (they run in the ``xla`` nox
session)."""

import importlib.util

import pytest

from nxd_state.testing import (
    SLOW_MARKER,
    add_preload,
    pin_cpu_test,
    skip_slow_unless_selected,
)

# Creating a torch optimizer imports torch._dynamo (seconds); the HF tests import transformers'
# model code (seconds per family).
add_preload(
    "torch._dynamo",
    "nxd_optim",
    "nxd_trainer",
    "nxd_trainer.hf",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SLOW_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow_unless_selected(config, items)
    if importlib.util.find_spec("torch_xla") is None:
        skip = pytest.mark.skip(reason="torch-xla is not installed here; run `nox -s xla`")
        for item in items:
            if "xla" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
