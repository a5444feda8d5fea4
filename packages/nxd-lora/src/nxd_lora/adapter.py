"""PEFT-format adapters: gather a (TP-sharded) LoRA model into one, and load one back.

A PEFT adapter is ``adapter_model.safetensors`` with full tensors named
``base_model.model.<module>.lora_A.weight`` (``lora_embedding_A`` for embeddings; biases as
``<module>.base_layer.bias``; ``modules_to_save`` under their own names) plus
``adapter_config.json``. Gathering all-gathers every TP-sharded tensor over its layer's TP group
(every rank of the group must call it); loading slices the full tensors for this rank, so an
adapter moves between TP degrees and to and from ``peft.PeftModel``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_layers import full_tensor
from nxd_lora._targets import peft_target_modules
from nxd_lora.config import LoraConfig
from nxd_lora.layers import copy_full_into
from nxd_lora.tp_layers import LoraGQAQKVParallelLinear

if TYPE_CHECKING:  # annotations only: the model calls into this module, never the reverse
    from nxd_lora.model import LoRAModel

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "PEFT_PREFIX",
    "gather_full_adapter_state_dict",
    "gather_peft_state_dict",
    "load_peft_adapter",
    "load_peft_state_dict",
    "peft_adapter_config",
    "read_peft_adapter",
    "save_peft_adapter",
]

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
NameMap = Callable[[str], str]


def _identity(name: str) -> str:
    return name


def _extra_parameters(model: LoRAModel) -> dict[str, torch.Tensor]:
    """Trainable non-adapter parameters saved with the adapter (biases, modules_to_save)."""
    return {
        name: param
        for name, param in model.module.named_parameters()
        if not model.is_adapter_key(name) and model.is_trainable_name(name)
    }


def gather_peft_state_dict(
    model: LoRAModel, *, name_map: NameMap | None = None
) -> dict[str, torch.Tensor]:
    """The full adapter under PEFT's key names (collective over TP: call on every rank).

    ``name_map`` renames module paths (nxd model -> Hugging Face model), e.g.
    ``lambda n: n.replace("decoder.", "model.")``.
    """
    rename = name_map or _identity
    out: dict[str, torch.Tensor] = {}
    for name, layer in model.lora_layers().items():
        for key, tensor in layer.peft_tensors(rename(name)).items():
            out[PEFT_PREFIX + key] = tensor
    layers = model.lora_layers()
    for name, param in _extra_parameters(model).items():
        owner = name.rpartition(".base_layer.")[0]
        if isinstance(layers.get(owner), LoraGQAQKVParallelLinear):
            raise NotImplementedError(
                f"{name}: biases of a fused QKV LoRA layer have no PEFT name (PEFT has separate "
                f"q/k/v modules); use bias='none' to export this model as a PEFT adapter"
            )
        group = getattr(model.module.get_submodule(owner), "tensor_parallel_group", None)
        out[PEFT_PREFIX + rename(name)] = full_tensor(param, group=group).clone()
    return out


def gather_full_adapter_state_dict(model: LoRAModel) -> dict[str, torch.Tensor]:
    """The adapter of the unsharded model under the model's own names (NxD's
    ``merge_sharded_lora``): every TP shard all-gathered, K/V replicas of a GQA layer reduced to
    one copy per head (``qkv_proj.lora_B.weight_q/_k/_v``, or ``weight_qkv`` when fused), biases
    as ``<module>.bias``. Collective over TP: call on every rank.
    """
    out: dict[str, torch.Tensor] = {}
    for name, layer in model.lora_layers().items():
        tensors = layer.peft_tensors(name)
        if isinstance(layer, LoraGQAQKVParallelLinear):
            modules = layer._peft_module_names(name)
            out[f"{name}.lora_A.weight"] = tensors[f"{modules[0]}.lora_A.weight"]
            parts = [tensors[f"{module}.lora_B.weight"] for module in modules]
            if layer.lora_B.fuse_qkv:
                out[f"{name}.lora_B.weight_qkv"] = torch.cat(parts)
            else:
                out.update({f"{name}.lora_B.weight_{p}": t for p, t in zip("qkv", parts)})
        else:
            out.update(tensors)
    for name, param in _extra_parameters(model).items():
        owner = name.rpartition(".base_layer.")[0]
        group = getattr(model.module.get_submodule(owner), "tensor_parallel_group", None)
        out[model.original_name(name)] = full_tensor(param, group=group).clone()
    return out


def peft_adapter_config(
    model: LoRAModel,
    *,
    name_map: NameMap | None = None,
    base_model_name_or_path: str | None = None,
    task_type: str | None = None,
) -> dict[str, Any]:
    """``adapter_config.json`` content whose ``target_modules`` select exactly nxd's targets."""
    rename = name_map or _identity
    config = model.lora_config
    exported = sorted(
        {key.rpartition(".lora_")[0] for key in gather_names(model, rename) if ".lora_" in key}
    )
    all_names = [rename(name) for name, _ in model.module.named_modules() if name]
    targets = peft_target_modules(config.target_modules or [], exported, all_names)
    if task_type is None and hasattr(model.module, "generate"):
        task_type = "CAUSAL_LM" if "CausalLM" in type(model.module).__name__ else None
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(
            getattr(model.module, "config", None), "_name_or_path", None
        )
    return config.to_peft_dict(
        target_modules=targets,
        base_model_name_or_path=base_model_name_or_path or None,
        task_type=task_type,
    )


def gather_names(model: LoRAModel, rename: NameMap) -> list[str]:
    """PEFT key names (without the prefix) of the adapter tensors, without communicating."""
    names = []
    for name, layer in model.lora_layers().items():
        names.extend(layer.peft_tensor_names(rename(name)))
    return names


def save_peft_adapter(
    model: LoRAModel,
    save_dir: str | os.PathLike[str],
    *,
    name_map: NameMap | None = None,
    base_model_name_or_path: str | None = None,
    metadata: Mapping[str, str] | None = None,
    write: bool = True,
) -> dict[str, torch.Tensor]:
    """Gather (collective) and, where ``write``, save ``adapter_model.safetensors`` and
    ``adapter_config.json`` in ``save_dir``. Returns the gathered state dict."""
    from safetensors.torch import save_file

    state = gather_peft_state_dict(model, name_map=name_map)
    config = peft_adapter_config(
        model, name_map=name_map, base_model_name_or_path=base_model_name_or_path
    )
    if write:
        directory = Path(save_dir)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(
            tensors, directory / ADAPTER_WEIGHTS_NAME, metadata={"format": "pt", **(metadata or {})}
        )
        (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
        logger.info("saved a PEFT adapter of %d tensors to %s", len(tensors), directory)
    return state


def load_peft_state_dict(
    model: LoRAModel, state_dict: Mapping[str, torch.Tensor], *, name_map: NameMap | None = None
) -> None:
    """Copy a full PEFT-named adapter into ``model`` (this rank's slices); keys must match."""
    rename = name_map or _identity
    tensors = {
        key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key: value
        for key, value in state_dict.items()
    }
    used: set[str] = set()
    for name, layer in model.lora_layers().items():
        used.update(layer.load_peft_tensors(rename(name), tensors))
    for name, param in _extra_parameters(model).items():
        key = rename(name)
        if key not in tensors:
            raise ValueError(
                f"the adapter has no tensor {key!r} (bias={model.lora_config.bias!r}, "
                f"modules_to_save={model.lora_config.modules_to_save})"
            )
        owner = name.rpartition(".base_layer.")[0]
        group = getattr(model.module.get_submodule(owner), "tensor_parallel_group", None)
        copy_full_into(param, tensors[key], key, group)
        used.add(key)
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise ValueError(
            f"the adapter holds tensors this LoRA model has no place for: {unexpected[:8]} "
            f"(LoRA modules: {model.lora_module_names[:8]})"
        )


def read_peft_adapter(
    adapter_dir: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    """``(adapter_config.json, tensors, safetensors metadata)`` of a PEFT adapter folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    directory = Path(adapter_dir)
    weights = directory / ADAPTER_WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {ADAPTER_WEIGHTS_NAME} in {directory}")
    with safe_open(str(weights), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    config_path = directory / ADAPTER_CONFIG_NAME
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return config, load_file(str(weights)), metadata


def load_peft_adapter(
    model: LoRAModel, adapter_dir: str | os.PathLike[str], *, name_map: NameMap | None = None
) -> None:
    """Load a PEFT adapter folder into ``model``; its config must match the model's.

    Raises when ``r``, ``lora_alpha``, rsLoRA, ``bias``, targets ... differ (listing each
    difference), or when tensors are missing, unexpected or of the wrong shape.
    """
    peft_config, tensors, _ = read_peft_adapter(adapter_dir)
    if not peft_config:
        raise FileNotFoundError(f"no {ADAPTER_CONFIG_NAME} in {adapter_dir}")
    saved = LoraConfig.from_peft_dict(peft_config)
    differences = [
        d
        for d in model.lora_config.mismatches(saved)
        if not d.startswith(("target_modules", "init_lora_weights", "lora_dropout"))
    ]
    if differences:
        raise ValueError(
            f"adapter in {adapter_dir} does not match this LoRA model (model vs adapter): "
            + "; ".join(differences)
        )
    load_peft_state_dict(model, tensors, name_map=name_map)
