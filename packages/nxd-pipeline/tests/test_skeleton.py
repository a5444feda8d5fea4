"""The skeleton installs, imports, and reports the version its metadata declares."""

import importlib.metadata

import nxd_pipeline


def test_version_matches_distribution_metadata() -> None:
    assert nxd_pipeline.__version__ == importlib.metadata.version("nxd-pipeline")
