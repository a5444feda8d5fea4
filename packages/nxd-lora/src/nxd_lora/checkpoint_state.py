"""A ``LoRAModel``'s checkpoint state (the protocol of :mod:`nxd_state.shards`): what its save
mode stores, sharded like any model tensor, so it reshards.

The save mode (:attr:`nxd_lora.LoraConfig.save_mode`, decided there alone) picks the tensors:

* ``adapter`` (``save_lora_base=False``, or ``merge_sharded_lora``): the adapter
  (``lora_A``/``lora_B``, trained biases, ``modules_to_save``);
* ``base_and_adapter`` (``save_lora_base=True``): the base model too;
* ``merged`` (``merge_lora=True``): the base with ``W + s·BA`` and no adapter; a load fills
  the base weights themselves.

Names are the unwrapped model's; specs come from the layers' sharding attributes
(:func:`nxd_layers.tensor_shard_spec`). :func:`lora_checkpoint_metadata` is what a checkpoint
index keeps beside them: the mode, the config fields NxD saves with an adapter, the PEFT
``adapter_config.json`` and each adapter tensor's PEFT key (so an adapter exports to PEFT).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from nxd_layers import tensor_shard_spec
from nxd_state.shards import CheckpointTensor, CheckpointTensors, RankContext

if TYPE_CHECKING:
    from nxd_lora.model import LoraModel

__all__ = ["lora_checkpoint_metadata", "lora_checkpoint_tensors"]


def lora_checkpoint_tensors(
    model: LoraModel, ctx: RankContext, *, for_load: bool = False
) -> CheckpointTensors:
    """The tensors ``model``'s save mode stores, under the unwrapped model's names; for
    ``merged`` the merged weights (when saving, unless merged already) with the base
    parameters' sharding, and the base parameters themselves ``for_load``."""
    mode = model.lora_config.save_mode
    modules = dict(model.module.named_modules())
    params = dict(model.module.named_parameters())
    out = []
    for wrapped, tensor in model.module.state_dict(keep_vars=True).items():
        adapter = model.is_adapter_key(wrapped) or (
            wrapped in params and model.is_trainable_name(wrapped)
        )
        if (mode == "adapter" and not adapter) or (
            mode == "merged" and model.is_adapter_key(wrapped)
        ):
            continue
        prefix, _, leaf = wrapped.rpartition(".")
        spec = tensor_shard_spec(
            tensor,
            tp_rank=ctx.tp_rank,
            tp_size=ctx.tp_size,
            module=modules.get(prefix),
            local_name=leaf,
            ep_rank=ctx.ep_rank,
            ep_size=ctx.ep_size,
            what=wrapped,
        )
        out.append(CheckpointTensor(model.original_name(wrapped), tensor, spec))
    if mode == "merged" and not for_load and not model.is_lora_merged:
        by_name = {local.name: local for local in out}
        for lora_name, layer in model.lora_layers().items():
            for param_name, weight in layer.merged_base_weights().items():
                by_name[f"{lora_name}.{param_name}"].tensor = weight
    return CheckpointTensors(out)


def lora_checkpoint_metadata(model: LoraModel) -> dict[str, Any]:
    """``{"lora": ...}``: the mode, NxD's saved config fields, the PEFT config and the PEFT
    key of each adapter tensor (None when a layer stores it otherwise, e.g. a fused QKV)."""
    from nxd_lora.adapter import PEFT_PREFIX, peft_adapter_config

    mode = model.lora_config.save_mode
    meta: dict[str, Any] = {"mode": mode, "config": model.lora_config.selected_fields_to_save()}
    if mode == "merged":
        return {"lora": meta}
    peft_names: dict[str, str] = {}
    exportable = True
    for lora_name, layer in model.lora_layers().items():
        own = [f"{lora_name}.{p}" for p in layer.adapter_parameters()]
        if layer.peft_tensor_names(lora_name) != own:  # e.g. a fused QKV split into q/k/v
            exportable = False
        peft_names.update({name: PEFT_PREFIX + name for name in own})
    for wrapped, _ in model.module.named_parameters():
        if not model.is_adapter_key(wrapped) and model.is_trainable_name(wrapped):
            peft_names[model.original_name(wrapped)] = PEFT_PREFIX + wrapped
    meta["peft_names"] = peft_names if exportable else None
    meta["peft_config"] = json.loads(json.dumps(peft_adapter_config(model), default=str))
    return {"lora": meta}
