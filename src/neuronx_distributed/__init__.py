"""NeuronX Distributed compatibility: NxD's import paths, backed by the nxd packages.

An NxD script ports by changing ``neuronx_distributed`` imports to this package (it has the
same name): ``from neuronx_distributed import parallel_state`` and friends resolve to nxd.
Submodules are imported on first use, so installing part of nxd is enough for the parts used.
"""

from importlib.metadata import version as _version

__version__ = _version("nxd")

__all__ = ["__version__"]
