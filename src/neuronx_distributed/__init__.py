"""NeuronX Distributed compatibility: NxD's import paths, backed by the nxd packages.

An NxD script ports by changing ``neuronx_distributed`` imports to this package (it has the
same name): ``import neuronx_distributed as nxd`` then ``nxd.neuronx_distributed_config(...)``,
``from neuronx_distributed import parallel_state`` and friends resolve to nxd. Submodules and
the top-level trainer names are imported on first use, so ``import neuronx_distributed`` stays
cheap and a script only pays for what it touches.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import Any

__version__ = _version("open-nxd")  # the distribution that ships this package

# NxD's top-level names, each resolved from its module on first access (PEP 562).
_LAZY = {
    "neuronx_distributed_config": "neuronx_distributed.trainer",
    "initialize_parallel_model": "neuronx_distributed.trainer",
    "initialize_parallel_optimizer": "neuronx_distributed.trainer",
    "save_checkpoint": "neuronx_distributed.trainer",
    "load_checkpoint": "neuronx_distributed.trainer",
    "has_checkpoint": "neuronx_distributed.trainer",
    "finalize_checkpoint": "neuronx_distributed.trainer",
}
_SUBMODULES: tuple[str, ...] = ("lightning", "modules", "optimizer", "parallel_layers")
_SUBMODULES += ("pipeline", "trace", "trainer", "utils", "parallel_state", "overrides")

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'neuronx_distributed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})
