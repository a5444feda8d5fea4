"""NxD's ``neuronx_distributed.parallel_layers.parallel_state``: :mod:`nxd_state`'s functions."""

from nxd_state.parallel_state import *  # noqa: F403
from nxd_state.parallel_state import __all__ as __all__
