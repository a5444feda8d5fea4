"""NxD's ``neuronx_distributed.pipeline.comm``: tensors to the next / from the previous stage.

NxD's pickled-object transfers (``send_python_object`` / ``recv_python_object``) are not
provided: nxd moves tensors only.
"""

from neuronx_distributed.parallel_layers.parallel_state import rmsg
from nxd_pipeline import recv_from, send

__all__ = ["recv_from", "rmsg", "send"]
