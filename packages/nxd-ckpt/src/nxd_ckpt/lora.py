"""LoRA models in checkpoints: NxD's three save modes, PEFT export, ``load_lora_from_ckpt``.

For an ``nxd_lora.LoRAModel`` the config's save mode picks what ``save_checkpoint`` stores
(sharded like any model tensor, so it reshards); the model says so itself
(``LoRAModel.checkpoint_tensors`` / ``checkpoint_metadata``, :mod:`nxd_lora.checkpoint_state`):

* ``adapter`` (``save_lora_base=False``): the adapter (``lora_A``/``lora_B``, trained biases,
  ``modules_to_save``), under the unwrapped model's names;
* ``base_and_adapter`` (``save_lora_base=True``): the base model too;
* ``merged`` (``merge_lora=True``): the base with ``W + s·BA`` and no adapter.

The index keeps the mode, the LoRA config fields NxD saves with an adapter, the PEFT
``adapter_config.json`` and each adapter tensor's PEFT key, so :func:`export_peft_adapter`
writes a folder ``peft.PeftModel.from_pretrained`` loads. :func:`load_lora_from_ckpt` is
NxD's ``load_lora_from_ckpt`` / ``lora_save_dir`` / ``lora_load_tag`` for such tags (and
falls back to nxd_lora's loader for folders that nxd_lora wrote).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from nxd_ckpt.layout._context import RankContext, current_context
from nxd_ckpt.layout._model_tensors import LocalTensor

__all__ = ["export_peft_adapter", "is_lora_model", "load_lora_from_ckpt", "lora_tensors"]

logger = logging.getLogger(__name__)


def is_lora_model(model: Any) -> bool:
    """Whether ``model`` is an ``nxd_lora.LoRAModel``."""
    from nxd_lora import LoRAModel

    return isinstance(model, LoRAModel)


def lora_tensors(model: Any, ctx: RankContext, *, for_load: bool = False) -> list[LocalTensor]:
    """The tensors a ``LoRAModel``'s save mode stores (``LoRAModel.checkpoint_tensors``,
    :mod:`nxd_lora.checkpoint_state`: the one place its save modes are decided)."""
    described = model.checkpoint_tensors(ctx, for_load=for_load)
    return [LocalTensor(t.name, t.tensor, t.spec) for t in described.tensors]


def export_peft_adapter(reader: Any, out_dir: Path, *, progress: bool = True) -> Path:
    """Write an adapter-only tag as a PEFT folder (``adapter_model.safetensors`` +
    ``adapter_config.json``), tensor by tensor."""
    from nxd_ckpt.format._stfile import dtype_from_name, plan_file, write_planned
    from nxd_lora import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

    meta = reader.index.lora
    names = meta.get("peft_names")
    if names is None:
        raise NotImplementedError(
            f"{reader.tag_dir}: this adapter has layers PEFT stores differently (a fused QKV "
            f"projection): export it with nxd_lora.save_peft_adapter from the model instead"
        )
    records = reader.index.category("model")
    items = [
        (names[name], dtype_from_name(records[name].dtype), tuple(records[name].shape))
        for name in records
    ]
    plan = plan_file(items, {"format": "pt"})
    by_key = {names[name]: name for name in records}
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [
        (lambda name=by_key[e.key]: reader.read_full("model", name).contiguous())
        for e in plan.entries
    ]
    write_planned(out_dir / ADAPTER_WEIGHTS_NAME, plan, sources)
    (out_dir / ADAPTER_CONFIG_NAME).write_text(json.dumps(meta["peft_config"], indent=2))
    logger.info("exported the LoRA adapter of %s to %s (PEFT)", reader.tag_dir, out_dir)
    return out_dir


def load_lora_from_ckpt(model: Any, *, strict: bool = True) -> None:
    """NxD's ``load_lora_from_ckpt``: load ``lora_save_dir``/``lora_load_tag`` of the model's
    LoRA config into ``model`` (an ``nxd_lora.LoRAModel``), adopting the saved LoRA config.
    A tag written by ``save_checkpoint`` is read at any TP/PP/DP layout; a folder written by
    ``nxd_lora.save_lora`` goes to nxd_lora's loader. Collective."""
    from nxd_ckpt.format import INDEX_NAME
    from nxd_ckpt.format._contain import check_tag, is_regular, real_dir
    from nxd_ckpt.load._reader import CheckpointReader
    from nxd_lora import load_lora_checkpoint_into

    config = model.lora_config
    root = Path(config.lora_save_dir)
    tag = check_tag(config.lora_load_tag or "", "lora_load_tag")
    folder = root / tag if tag else root
    if tag and os.path.lexists(folder):
        real_dir(folder, "LoRA checkpoint tag folder")
    if not is_regular(folder / INDEX_NAME):
        load_lora_checkpoint_into(model)
        return
    with CheckpointReader(folder) as reader:
        _load_lora_tag(model, reader, config, strict)


def _load_lora_tag(model: Any, reader: Any, config: Any, strict: bool) -> None:
    from nxd_ckpt.load._load_model import load_model

    folder = reader.tag_dir
    saved = reader.index.lora
    if saved is None:
        raise ValueError(f"{folder} is a checkpoint of a model without LoRA (no LoRA metadata)")
    model.lora_config = config.with_saved_fields(saved["config"])
    if saved["mode"] != "merged":
        model.inject_adapter()
    load_model(model, reader, current_context(), strict)
    logger.info("loaded LoRA checkpoint %s (%s)", folder, saved["mode"])
