"""The skeleton installs, imports, and reports the version its metadata declares."""

import importlib.metadata

import nxd_lora


def test_version_matches_distribution_metadata() -> None:
    assert nxd_lora.__version__ == importlib.metadata.version("nxd-lora")
