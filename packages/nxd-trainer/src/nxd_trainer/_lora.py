"""LoRA in ``initialize_parallel_model``, including NxD's ``load_lora_from_ckpt``.

``lora_config.load_lora_from_ckpt`` resumes an adapter from ``lora_save_dir`` /
``lora_load_tag``. Two folder kinds exist:

* a tag written by ``save_checkpoint`` (nxd-ckpt's ``index.json``): the saved LoRA config wins
  (rank, alpha, targets ... as NxD says), the adapter is injected with it and the saved tensors
  (adapter, or base + adapter) are read at this rank's layout, whatever the degrees they were
  saved at. A *merged* tag holds a base model with the adapter folded in and no adapter: it is
  loaded as the base, and a fresh adapter (the saved config's) is injected on top of it;
* a folder written by ``nxd_lora.save_lora`` (PEFT files): nxd-lora's own loader.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["lora_checkpoint_folder", "wrap_lora"]

logger = logging.getLogger(__name__)


def lora_checkpoint_folder(config: Any) -> Path | None:
    """The nxd-ckpt tag ``load_lora_from_ckpt`` reads, or None (off, or nxd-lora's layout)."""
    from nxd_ckpt.format import INDEX_NAME

    if not config.load_lora_from_ckpt:
        return None
    root = Path(config.lora_save_dir)
    folder = root / config.lora_load_tag if config.lora_load_tag else root
    return folder if (folder / INDEX_NAME).is_file() else None


def wrap_lora(model: nn.Module, config: Any) -> nn.Module:
    """``nxd_lora.LoRAModel(model, config)``, loading the adapter of an nxd-ckpt tag when
    ``load_lora_from_ckpt`` names one (collective then: every rank calls it)."""
    from nxd_lora import LoRAModel

    folder = lora_checkpoint_folder(config)
    if folder is None:
        return LoRAModel(model, config)
    import nxd_ckpt
    from nxd_ckpt.lora import load_lora_from_ckpt

    saved = nxd_ckpt.read_index(folder).lora
    if saved is None:
        raise ValueError(
            f"lora_config['load_lora_from_ckpt'] names {folder}, a checkpoint of a model "
            f"without LoRA (save it from a model built with lora_config)"
        )
    # Inject with the saved adapter settings (NxD: the checkpoint's LoRA config wins).
    adopted = dataclasses.replace(
        config.with_saved_fields(saved["config"]), load_lora_from_ckpt=False
    )
    if saved["mode"] == "merged":
        nxd_ckpt.load_checkpoint(folder.parent, folder.name, model=model, load_rng=False)
        logger.info("loaded the merged LoRA base of %s; injecting a fresh adapter", folder)
        return LoRAModel(model, adopted)
    wrapped = LoRAModel(model, adopted)
    load_lora_from_ckpt(wrapped)
    logger.info("loaded the LoRA checkpoint %s (%s)", folder, saved["mode"])
    return wrapped
