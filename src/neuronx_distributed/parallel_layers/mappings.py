"""NxD's ``neuronx_distributed.parallel_layers.mappings``: :mod:`nxd_layers.mappings`."""

from nxd_layers.mappings import *  # noqa: F403
from nxd_layers.mappings import __all__ as __all__
