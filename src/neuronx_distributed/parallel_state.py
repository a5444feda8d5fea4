"""NxD's ``neuronx_distributed.parallel_state``: the functions of :mod:`nxd_state`."""

from nxd_state.parallel_state import *  # noqa: F403
from nxd_state.parallel_state import __all__ as __all__
