"""Forkserver preloads for the rank processes; the ``slow`` marker (heavier variants, run with
``-m slow``); the skip of ``xla`` tests without torch-xla (they run in the ``xla`` nox
session)."""

import importlib.util

import pytest

from nxd_state.testing import add_preload, pin_cpu_test

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
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: heavier variants; selected with -m slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = []
    if importlib.util.find_spec("torch_xla") is None:
        reason = "torch-xla is not installed here; run `nox -s xla`"
        skips.append(("xla", pytest.mark.skip(reason=reason)))
    if "slow" not in (config.getoption("-m") or ""):
        skips.append(("slow", pytest.mark.skip(reason="slow variant: run with -m slow")))
    for item in items:
        for keyword, skip in skips:
            if keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
