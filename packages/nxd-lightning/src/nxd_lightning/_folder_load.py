"""``Model.load_from_checkpoint(folder)`` for the checkpoints :class:`NeuronCheckpointIO` writes.

Lightning's ``load_from_checkpoint`` reads a checkpoint with one ``torch.load`` of a file; an
nxd checkpoint is a folder (an nxd-ckpt tag) and opening it fails with ``IsADirectoryError``.
Importing ``nxd_lightning`` wraps the reader Lightning's ``load_from_checkpoint`` calls
(``lightning.pytorch.core.saving.pl_load``): a folder written by nxd-lightning is read as

* Lightning's checkpoint dict (epoch, global step, hyper-parameters, callback states …) from
  the tag's JSON user content, and
* ``state_dict``: every model tensor **whole** (the global tensor, assembled from the TP / PP
  shards it was saved in), under the names it was saved with (a plain LightningModule's own
  state-dict names),

so the class builds itself from its saved hyper-parameters and loads the unsharded weights, as
from Lightning's own file. Anything else goes to Lightning's reader unchanged. No pickle: the
tensors come from safetensors, the rest from JSON. Without a process group this reads in one
process; inside a job every rank must call it together (nxd-ckpt's load is collective).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["install", "is_lightning_tag", "read_lightning_checkpoint"]

_MARK = "_nxd_lightning_folder_reader"


def is_lightning_tag(path: Any) -> bool:
    """Whether ``path`` is a folder holding an nxd-ckpt tag (``index.json``)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    folder = Path(os.fspath(path))
    return folder.is_dir() and (folder / "index.json").is_file()


def _holder(names: dict[str, Any]) -> nn.Module:
    """A module with one parameter per saved name, of the saved global shape and dtype."""
    root = nn.Module()
    for name, record in names.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]  # type: ignore[assignment]
        dtype = getattr(torch, record.dtype)
        module.register_parameter(
            leaf, nn.Parameter(torch.empty(record.shape, dtype=dtype), requires_grad=False)
        )
    return root


def read_lightning_checkpoint(path: Any, map_location: Any = None) -> dict[str, Any]:
    """Lightning's checkpoint dict of an nxd-lightning tag folder (module docstring)."""
    import nxd_ckpt
    from nxd_lightning.checkpoint_io import read_loop_state

    folder = Path(os.fspath(path))
    checkpoint = read_loop_state(folder)
    index = nxd_ckpt.read_index(folder)
    records = {
        name: index.category("model")[index.resolve("model", name)] for name in index.names("model")
    }
    holder = _holder(records)
    nxd_ckpt.load_checkpoint(folder.parent, folder.name, model=holder, load_rng=False)
    state = {name: tensor.detach() for name, tensor in holder.state_dict().items()}
    if isinstance(map_location, (str, torch.device)):
        state = {name: tensor.to(map_location) for name, tensor in state.items()}
    checkpoint["state_dict"] = state
    return checkpoint


def install() -> None:
    """Wrap ``lightning.pytorch.core.saving.pl_load`` (once): nxd-lightning folders are read
    by :func:`read_lightning_checkpoint`, anything else by Lightning."""
    from lightning.pytorch.core import saving

    original = saving.pl_load
    if getattr(original, _MARK, False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if is_lightning_tag(path_or_url):
            return read_lightning_checkpoint(path_or_url, map_location)
        return original(path_or_url, map_location, *args, **kwargs)

    setattr(pl_load, _MARK, True)
    saving.pl_load = pl_load
