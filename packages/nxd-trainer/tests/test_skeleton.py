"""The skeleton installs, imports, and reports the version its metadata declares."""

import importlib.metadata

import nxd_trainer


def test_version_matches_distribution_metadata() -> None:
    assert nxd_trainer.__version__ == importlib.metadata.version("nxd-trainer")
