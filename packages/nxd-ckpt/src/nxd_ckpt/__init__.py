"""nxd-ckpt: sharded safetensors checkpoints that reshard across TP/PP/DP.

* :func:`save_checkpoint` / :func:`load_checkpoint`: NxD's trainer checkpoint API. Each rank
  writes the tensors it owns once (DP replicas share the work) into safetensors files; one
  JSON index per tag records every tensor's global shape and the boxes that make it up, so a
  checkpoint loads under any TP/PP/DP degrees and ZeRO-1 setting, each rank reading only the
  byte ranges it needs. No pickle: loading never executes code. ``done`` marks a complete tag;
  a crash at any moment of a save never damages an earlier one. ``async_save`` writes in the
  background from a host copy.
* :func:`read_user_content`: a tag's user content alone, in any one process (no collective,
  no RNG restore, nothing else read).
* :func:`verify_tag` / :func:`newest_intact_tag`: check tags without loading them (index,
  sizes, headers, CRCs) and find the newest intact one, with the newer damaged ones and why
  (a resume's fallback).
* Contained and all-or-nothing: every path a call touches stays inside the folder the user
  named (plain tag names, contained index paths, no symbolic link followed:
  :class:`ContainmentError`); a load validates its whole plan before it changes anything;
  retention deletes only tags nxd-ckpt wrote (its ``nxd-ckpt.json`` marker) and reports a
  problem as a :class:`RetentionWarning` after the new tag committed.
* :func:`export_hf` / :func:`load_hf_checkpoint`: Hugging Face folders out and in.
* :func:`load_nxd_checkpoint` / :func:`convert_nxd_checkpoint`: NxD's own pickled layout,
  read with ``torch.load(weights_only=True)`` only.
* :mod:`nxd_ckpt.legacy`: NxD's ``parallel_layers.save`` / ``load``.
* :class:`StoredPart` (:mod:`nxd_ckpt.parts`): a module's declaration of the names its
  parameters are stored under (one degree-independent name for a layout that depends on TP).
* :mod:`nxd_ckpt.format`: the on-disk format (index dataclasses, format version); the
  ``nxd-ckpt`` command (:mod:`nxd_ckpt.cli`): ``info``, ``export-hf``, ``convert-nxd``.
"""

from importlib.metadata import version as _version

from nxd_ckpt.checkpoint import (
    async_copy_waited_s,
    finalize_checkpoint,
    has_checkpoint,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from nxd_ckpt.format import (
    FORMAT_VERSION,
    CheckpointIndex,
    ContainmentError,
    FormatError,
    read_index,
)
from nxd_ckpt.format._tags import RetentionWarning
from nxd_ckpt.hf import export_hf, load_hf_checkpoint
from nxd_ckpt.integrity import DamagedTag, IntactTag, newest_intact_tag, verify_tag
from nxd_ckpt.nxd_convert import convert_nxd_checkpoint
from nxd_ckpt.nxd_format import is_nxd_checkpoint, load_nxd_checkpoint
from nxd_ckpt.parts import CHECKPOINT_PARTS, StoredPart
from nxd_ckpt.user_content import read_user_content

__version__ = _version("nxd-ckpt")

__all__ = [
    "CHECKPOINT_PARTS",
    "FORMAT_VERSION",
    "CheckpointIndex",
    "ContainmentError",
    "DamagedTag",
    "FormatError",
    "IntactTag",
    "RetentionWarning",
    "StoredPart",
    "__version__",
    "async_copy_waited_s",
    "convert_nxd_checkpoint",
    "export_hf",
    "finalize_checkpoint",
    "has_checkpoint",
    "is_nxd_checkpoint",
    "load_checkpoint",
    "load_hf_checkpoint",
    "load_nxd_checkpoint",
    "newest_intact_tag",
    "read_index",
    "read_user_content",
    "remove_checkpoint",
    "save_checkpoint",
    "verify_tag",
]
