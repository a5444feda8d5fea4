"""NxD's LoRA save modes on disk, and ``load_lora_from_ckpt``.

``save_lora`` writes ``<lora_save_dir>/<tag>/`` according to the config's save mode:

* adapter only (``save_lora_base=False``): ``adapter_model.safetensors`` + ``adapter_config.json``
  (PEFT format: ``peft.PeftModel.from_pretrained`` loads the folder);
* base and adapter (``save_lora_base=True``): the same plus ``model.safetensors``, the base
  weights under the unwrapped model's names;
* merged (``save_lora_base=True, merge_lora=True``): ``model.safetensors`` holding
  ``W + s · B A`` and no adapter.

Tensors are full (TP shards gathered), so a checkpoint loads at any TP degree. With
``save_lora_config_adapter`` the nxd config is stored in the safetensors metadata; otherwise
it is written as ``<lora_save_dir>/adapter_config.json``. The sharded, per-rank checkpoint of
a training run is the checkpoint package's job: it writes :meth:`LoRAModel.state_dict`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nxd_layers import full_tensor
from nxd_lora.adapter import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    NameMap,
    load_peft_state_dict,
    peft_adapter_config,
    read_peft_adapter,
    save_peft_adapter,
)
from nxd_lora.config import LoraConfig
from nxd_lora.layers import copy_full_into

if TYPE_CHECKING:  # annotations only: the model calls into this module, never the reverse
    from nxd_lora.model import LoRAModel

__all__ = [
    "BASE_WEIGHTS_NAME",
    "gather_base_state_dict",
    "load_lora_checkpoint_into",
    "lora_checkpoint_dir",
    "save_lora",
]

logger = logging.getLogger(__name__)

BASE_WEIGHTS_NAME = "model.safetensors"
_CONFIG_KEY = "nxd_lora_config"


def lora_checkpoint_dir(save_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """``save_dir/tag``, or ``save_dir`` when there is no tag."""
    return Path(save_dir) / tag if tag else Path(save_dir)


def _is_writer() -> bool:
    """One writer per model replica set: TP rank 0 of DP rank 0 (global rank 0 without nxd)."""
    if not dist.is_initialized():
        return True
    from nxd_state import get_parallel_state, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return dist.get_rank() == 0
    state = get_parallel_state()
    if state.pipeline_parallel_size > 1:
        raise NotImplementedError(
            f"saving a gathered LoRA checkpoint with pipeline_parallel_size="
            f"{state.pipeline_parallel_size} is not supported: each stage holds other layers; "
            "save the per-rank LoRAModel.state_dict() with the checkpoint package instead"
        )
    return state.tensor_parallel_rank == 0 and state.data_parallel_rank == 0


def _owner_group(model: LoRAModel, wrapped_name: str) -> Any:
    owner = wrapped_name.rpartition(".")[0]
    while owner:
        group = getattr(model.module.get_submodule(owner), "tensor_parallel_group", None)
        if group is not None:
            return group
        owner = owner.rpartition(".")[0]
    return None


def gather_base_state_dict(model: LoRAModel, *, merged: bool) -> dict[str, torch.Tensor]:
    """The full base state (original names), merged with the adapter when asked (collective)."""
    params = dict(model.module.named_parameters())
    out = {}
    for name, value in model.base_state_dict(merged=merged).items():
        wrapped = model.wrapped_name(name)
        param = params.get(wrapped)
        if param is None:  # a buffer: replicated
            out[name] = value.detach().clone()
        else:
            out[name] = full_tensor(param, value, group=_owner_group(model, wrapped)).clone()
    return out


def save_lora(
    model: LoRAModel,
    save_dir: str | os.PathLike[str] | None = None,
    tag: str | None = None,
    *,
    name_map: NameMap | None = None,
) -> Path:
    """Write the config's save mode to ``save_dir/tag`` (collective over TP; one rank writes)."""
    from safetensors.torch import save_file

    config = model.lora_config
    root = Path(save_dir if save_dir is not None else config.lora_save_dir)
    directory = lora_checkpoint_dir(root, tag)
    writer = _is_writer()
    metadata = (
        {_CONFIG_KEY: json.dumps(config.selected_fields_to_save())}
        if config.save_lora_config_adapter
        else {}
    )
    mode = config.save_mode
    if mode != "merged":
        save_peft_adapter(model, directory, name_map=name_map, metadata=metadata, write=writer)
    if mode != "adapter":
        base = gather_base_state_dict(model, merged=mode == "merged")
        if writer:
            directory.mkdir(parents=True, exist_ok=True)
            tensors = {k: v.detach().cpu().contiguous() for k, v in base.items()}
            save_file(tensors, directory / BASE_WEIGHTS_NAME, metadata={"format": "pt", **metadata})
    if not config.save_lora_config_adapter:
        peft_config = peft_adapter_config(model, name_map=name_map)
        if writer:
            root.mkdir(parents=True, exist_ok=True)
            (root / ADAPTER_CONFIG_NAME).write_text(
                json.dumps(peft_config, indent=2, sort_keys=True)
            )
    if writer:
        logger.info("saved LoRA checkpoint (%s) to %s", mode, directory)
    return directory


def _saved_fields(directory: Path, root: Path, metadatas: list[dict[str, str]]) -> dict[str, Any]:
    for metadata in metadatas:
        if _CONFIG_KEY in metadata:
            return json.loads(metadata[_CONFIG_KEY])
    for path in (directory / ADAPTER_CONFIG_NAME, root / ADAPTER_CONFIG_NAME):
        if path.is_file():
            return LoraConfig.from_peft_dict(json.loads(path.read_text())).adapter_fields()
    raise FileNotFoundError(
        f"no LoRA config found: neither safetensors metadata {_CONFIG_KEY!r} in {directory} nor "
        f"{ADAPTER_CONFIG_NAME} in {directory} or {root}"
    )


def load_lora_checkpoint_into(model: LoRAModel) -> None:
    """NxD's ``load_lora_from_ckpt``: read ``lora_save_dir``/``lora_load_tag``, adopt the saved
    config, load the base weights if saved, inject the adapter and load it (sliced for TP)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    config = model.lora_config
    root = Path(config.lora_save_dir)
    directory = lora_checkpoint_dir(root, config.lora_load_tag)
    adapter_file, base_file = directory / ADAPTER_WEIGHTS_NAME, directory / BASE_WEIGHTS_NAME
    if not adapter_file.is_file() and not base_file.is_file():
        raise FileNotFoundError(
            f"no LoRA checkpoint in {directory}: expected {ADAPTER_WEIGHTS_NAME} and/or "
            f"{BASE_WEIGHTS_NAME} (lora_save_dir={config.lora_save_dir!r}, "
            f"lora_load_tag={config.lora_load_tag!r})"
        )
    metadatas = []
    for path in (adapter_file, base_file):
        if path.is_file():
            with safe_open(str(path), framework="pt") as handle:
                metadatas.append(dict(handle.metadata() or {}))
    saved = _saved_fields(directory, root, metadatas)
    model.lora_config = config.with_saved_fields(saved)
    logger.info("loading LoRA checkpoint %s with saved config %s", directory, saved)
    if base_file.is_file():
        base = load_file(str(base_file))
        params = dict(model.module.named_parameters())
        buffers = dict(model.module.named_buffers())
        unknown = sorted(set(base) - set(params) - set(buffers))
        if unknown:
            raise ValueError(f"{base_file} holds tensors the model does not have: {unknown[:8]}")
        for name, value in base.items():
            target = params[name] if name in params else buffers[name]  # both checked above
            copy_full_into(target, value, name, _owner_group(model, name))
    if not adapter_file.is_file():
        logger.info("%s holds a merged base and no adapter: LoRA is not injected", directory)
        return
    model.inject_adapter()
    _, tensors, _ = read_peft_adapter(directory)
    load_peft_state_dict(model, tensors)
