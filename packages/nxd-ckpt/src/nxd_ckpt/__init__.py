"""nxd-ckpt: sharded safetensors checkpoints that reshard across TP/PP/DP.

* :func:`save_checkpoint` / :func:`load_checkpoint`: NxD's trainer checkpoint API. Each rank
  writes the tensors it owns once (DP replicas share the work) into safetensors files; one
  JSON index per tag records every tensor's global shape and the boxes that make it up, so a
  checkpoint loads under any TP/PP/DP degrees and ZeRO-1 setting, each rank reading only the
  byte ranges it needs. No pickle: loading never executes code. ``done`` marks a complete tag;
  a crash at any moment of a save never damages an earlier one. ``async_save`` writes in the
  background from a host copy.
* :mod:`nxd_ckpt.format`: the on-disk format (index dataclasses, format version).
"""

from importlib.metadata import version as _version

from nxd_ckpt.checkpoint import (
    finalize_checkpoint,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from nxd_ckpt.format import FORMAT_VERSION, CheckpointIndex, FormatError, read_index

__version__ = _version("nxd-ckpt")

__all__ = [
    "FORMAT_VERSION",
    "CheckpointIndex",
    "FormatError",
    "__version__",
    "finalize_checkpoint",
    "has_checkpoint",
    "load_checkpoint",
    "read_index",
    "save_checkpoint",
]
