"""nxd-trainer: not implemented yet; this package holds only its skeleton."""

from importlib.metadata import version as _version

__version__ = _version("nxd-trainer")

__all__ = ["__version__"]
