"""Tests marked ``xla`` need torch-xla; they run in the ``xla`` nox session."""

import importlib.util

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(reason="torch-xla is not installed here; run `nox -s xla`")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)
