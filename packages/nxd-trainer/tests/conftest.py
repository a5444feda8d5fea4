"""Forkserver preloads for the rank processes, and the skip of ``xla`` tests without torch-xla
(they run in the ``xla`` nox session)."""

import importlib.util

import pytest

from nxd_state.testing import add_preload

# Creating a torch optimizer imports torch._dynamo (seconds); the Llama tests import transformers.
add_preload("torch._dynamo", "nxd_optim", "nxd_trainer", "transformers.models.llama.modeling_llama")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(reason="torch-xla is not installed here; run `nox -s xla`")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)
