"""NxD's ``neuronx_distributed.parallel_state``: the same module as
``neuronx_distributed.parallel_layers.parallel_state``."""

from neuronx_distributed.parallel_layers.parallel_state import *  # noqa: F403
from neuronx_distributed.parallel_layers.parallel_state import __all__ as __all__
