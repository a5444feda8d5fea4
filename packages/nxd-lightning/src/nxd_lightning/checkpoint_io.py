"""Lightning checkpoints as nxd checkpoints: sharded safetensors plus the loop state as JSON.

Lightning names a checkpoint by a file path (``ckpts/epoch=0-step=4.ckpt``, ``ckpts/last.ckpt``);
here that path is an nxd-ckpt *tag* folder: ``ckpts`` is the checkpoint path and
``epoch=0-step=4.ckpt`` the tag (``index.json``, safetensors files, ``done`` last). In it:

* the model's tensors, each rank its shards, with their global shapes (so the checkpoint loads
  at other TP/PP/DP degrees, and exports to Hugging Face with ``nxd-ckpt export-hf``);
* the optimizer state by parameter name (ZeRO-1 shards included) and every rank's RNG states
  (restored when the layout is the saved one);
* the rest of Lightning's checkpoint dict (epoch, global step, loop progress, callback states
  such as ``ModelCheckpoint``'s best scores, LR schedulers, precision plugin) as nxd-ckpt user
  content: JSON, with any tensors in safetensors. No pickle anywhere: loading runs no code.

Every call is collective (every rank saves and loads its own part). ``save_load_xser`` is
NxD's switch for torch-xla's serialisation: accepted, and this format always writes tensor by
tensor, which is what xser is for.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch import nn

__all__ = ["LOADED_KEY", "NeuronCheckpointIO", "read_loop_state"]

logger = logging.getLogger(__name__)

# The key of Lightning's loop state inside nxd-ckpt's user content, and the format marker.
_CONTENT_KEY = "lightning"
_FORMAT_KEY = "format"
_FORMAT = "nxd-lightning/1"
LOADED_KEY = "_nxd_loaded_in_place"
"""Set in the dict :meth:`NeuronCheckpointIO.load_checkpoint` returns: the model and optimizer
were loaded in place, Lightning must not load ``state_dict`` again."""


def _split(path: Any) -> tuple[Path, str]:
    """(checkpoint folder, tag) of a Lightning checkpoint path."""
    full = Path(os.fspath(path))
    if not full.name:
        raise ValueError(f"checkpoint path {path!r} has no file name to use as the tag")
    return full.parent, full.name


def _single_optimizer(optimizers: Any) -> Any:
    optimizers = list(optimizers or [])
    if len(optimizers) > 1:
        raise ValueError(
            f"nxd checkpoints hold one optimizer; the module configured {len(optimizers)}"
        )
    return optimizers[0] if optimizers else None


def _loop_state(content: Any, path: Any) -> dict[str, Any]:
    if not isinstance(content, dict) or content.get(_FORMAT_KEY) != _FORMAT:
        raise ValueError(
            f"{path} is an nxd checkpoint but not one written by nxd-lightning (no "
            f"Lightning loop state in its user content): load it with "
            f"nxd_trainer.load_checkpoint"
        )
    return dict(content[_CONTENT_KEY])


def read_loop_state(tag_dir: Path) -> dict[str, Any]:
    """Lightning's checkpoint dict saved in tag folder ``tag_dir`` (without the model and
    optimizer), read in any one process."""
    import nxd_ckpt

    return _loop_state(nxd_ckpt.read_user_content(tag_dir.parent, tag_dir.name), tag_dir)


class NeuronCheckpointIO(CheckpointIO):
    """Save and load Lightning checkpoints with nxd-ckpt (module docstring).

    ``save_checkpoint(checkpoint, path)``: ``checkpoint["state_dict"]`` may be the model itself
    (an ``NxDModel`` or any module: what the NxD strategy passes) or a state dict;
    ``checkpoint["optimizer_states"]`` the optimizers themselves (at most one).
    """

    def __init__(self, save_load_xser: bool = True, weights_only: bool = False) -> None:
        super().__init__()
        self.save_load_xser = save_load_xser
        self.weights_only = weights_only

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        storage_options: Any | None = None,
        master_dp_only: bool = True,
    ) -> None:
        """Write tag ``basename(path)`` under ``dirname(path)``. ``master_dp_only`` (NxD's) is
        accepted: each tensor is written once, DP replicas sharing the work."""
        if storage_options is not None:
            raise TypeError(
                f"storage_options is not supported by NeuronCheckpointIO, got {storage_options!r}"
            )
        import nxd_trainer

        folder, tag = _split(path)
        content = dict(checkpoint)
        model = content.pop("state_dict", None)
        optimizer = _single_optimizer(content.pop("optimizer_states", None))
        if model is not None and not isinstance(model, (nn.Module, dict)):
            raise TypeError(
                f"checkpoint['state_dict'] must be a module or a state dict, got "
                f"{type(model).__qualname__}"
            )
        user_content = {_FORMAT_KEY: _FORMAT, _CONTENT_KEY: content}
        nxd_trainer.save_checkpoint(
            folder,
            tag,
            model=model,
            optimizer=optimizer,
            user_content=user_content,
            use_xser=self.save_load_xser,
        )
        logger.info("saved checkpoint %s", path)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        model: nn.Module | None = None,
        optimizers: Any = None,
        strict: bool = True,
    ) -> dict[str, Any]:
        """Load tag ``basename(path)``: ``model`` and the optimizer (if given) in place, and
        return Lightning's checkpoint dict (loop state) marked :data:`LOADED_KEY`.
        ``map_location`` and ``weights_only`` are accepted for Lightning's signature (loading
        never unpickles)."""
        import nxd_trainer

        folder, tag = _split(path)
        optimizer = _single_optimizer(optimizers)
        content = nxd_trainer.load_checkpoint(
            folder, tag, model=model, optimizer=optimizer, strict=strict
        )
        checkpoint = _loop_state(content, path)
        checkpoint[LOADED_KEY] = model is not None
        checkpoint.setdefault("state_dict", {})
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete tag ``basename(path)`` if nxd-ckpt wrote it (``done`` first: an interrupted
        deletion never leaves a tag that looks complete). Anything else at that path (a link,
        a file, a folder nxd-ckpt did not write) is left as it is, with a warning: Lightning's
        retention never deletes what this plugin did not save. Called on one rank."""
        import nxd_ckpt

        folder, tag = _split(path)
        try:
            removed = nxd_ckpt.remove_checkpoint(folder, tag)
        except (ValueError, OSError) as error:
            logger.warning("checkpoint %s not removed: %s", path, error)
            return
        if removed:
            logger.info("removed checkpoint %s", path)
