"""``LoRAModel``: wrap a model, put LoRA on the target modules, freeze the rest.

Every target module ``m`` (plain or tensor-parallel) is replaced by a LoRA layer holding ``m`` as
``base_layer``; only ``lora_*`` parameters (plus the biases of ``bias`` and the modules of
``modules_to_save``) keep ``requires_grad``. ``state_dict()`` returns what the save mode asks
for, with base parameters under their original names, so the base part loads into the plain
model and the checkpoint package can write it as is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nxd_lora._targets import default_target_modules, match_modules
from nxd_lora.checkpoint_state import lora_checkpoint_metadata, lora_checkpoint_tensors
from nxd_lora.config import LoraConfig
from nxd_lora.layers import LoraConv2d, LoraEmbedding, LoraLayer, LoraLinear
from nxd_state.shards import CheckpointTensors, RankContext

__all__ = [
    "LoRAModel",
    "LoraModel",
    "get_lora_model",
    "lora_layer_factories",
    "lora_requested",
]

logger = logging.getLogger(__name__)

_BASE = ".base_layer."


def lora_layer_factories() -> list[tuple[type, Callable[[Any, LoraConfig], LoraLayer]]]:
    """``(base type, LoRA layer class)`` pairs, most specific first (TP layers included)."""
    from nxd_lora import tp_layers

    return [
        *tp_layers.tp_layer_factories(),
        (nn.Embedding, LoraEmbedding),
        (nn.Conv2d, LoraConv2d),
        (nn.Linear, LoraLinear),
    ]


class LoraModel(nn.Module):
    """NxD's ``LoraModel(module, LoraConfig)`` (``LoRAModel`` in its API reference; one class
    under both names): ``module`` with LoRA on its target modules.

    With ``config.load_lora_from_ckpt`` the adapter saved in
    ``config.lora_save_dir``/``config.lora_load_tag`` is loaded (its saved config wins, as in
    NxD); see :mod:`nxd_lora.checkpoint`. A checkpoint read some other way can be handed over
    as NxD's loader does, ``model.lora_ckpt = state_dict``, and is loaded by the next
    :meth:`load_state_dict` (or passed to it as ``lora_ckpt=``).
    """

    prefix = "lora_"

    def __init__(self, module: nn.Module, config: LoraConfig) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(config, LoraConfig):
            raise TypeError(f"config must be a nxd_lora.LoraConfig, got {type(config).__name__}")
        super().__init__()
        self.module = module
        self.lora_config = config
        self.is_lora_merged = False
        self.lora_module_names: list[str] = []
        self.lora_ckpt: Mapping[str, Any] | None = None  # NxD's pending adapter checkpoint
        self.is_checkpoint_loaded = False
        if config.load_lora_from_ckpt:
            from nxd_lora.checkpoint import load_lora_checkpoint_into

            load_lora_checkpoint_into(self)  # reads the saved config, injects, loads
        else:
            self.inject_adapter()

    # Wrapping -------------------------------------------------------------------------------
    def inject_adapter(self) -> None:
        """Replace every target module by its LoRA layer, then freeze all but the adapter."""
        if self.lora_module_names:
            return
        config = self.lora_config
        if config.target_modules is None:
            config.target_modules = default_target_modules(self.module)
        factories = lora_layer_factories()
        supported = tuple(base for base, _ in factories)
        names = match_modules(self.module, config.target_modules, supported)
        for name in names:
            parent_name, _, child_name = name.rpartition(".")
            parent = self.module.get_submodule(parent_name) if parent_name else self.module
            target = getattr(parent, child_name)
            factory = next(f for base, f in factories if isinstance(target, base))
            setattr(parent, child_name, factory(target, config))
        self.lora_module_names = names
        self.mark_only_adapters_as_trainable()
        logger.info("LoRA on %d modules: %s", len(names), names)
        if config.lora_verbose:
            logger.info("LoRA model: %s", self.module)
            self.print_trainable_parameters()

    def lora_layers(self) -> dict[str, LoraLayer]:
        """``{module name: LoRA layer}`` in model order."""
        layers = {}
        for name in self.lora_module_names:
            layer = self.module.get_submodule(name)
            if not isinstance(layer, LoraLayer):
                raise TypeError(f"module {name!r} is a {type(layer).__name__}, no longer LoRA")
            layers[name] = layer
        return layers

    def mark_only_adapters_as_trainable(self) -> None:
        """``requires_grad`` only for adapters, the ``bias`` mode's biases, ``modules_to_save``."""
        for name, param in self.module.named_parameters():
            param.requires_grad_(self.is_trainable_name(name))

    def is_trainable_name(self, name: str) -> bool:
        """Whether the parameter ``name`` (module namespace, nxd naming) trains."""
        config = self.lora_config
        if self.is_adapter_key(name):
            return True
        if config.modules_to_save and any(key in name for key in config.modules_to_save):
            return True
        leaf = name.rpartition(".")[2]
        is_bias = leaf == "bias" or leaf.startswith("bias_")
        if config.bias == "all":
            return is_bias
        if config.bias == "lora_only":
            owner = name.rpartition(_BASE)[0] if _BASE in name else None
            return is_bias and owner in self.lora_module_names
        return False

    # Merging -------------------------------------------------------------------------------
    def merge_lora(self) -> None:
        """``W <- W + s · B A`` in every LoRA layer (forward then skips the adapter path)."""
        for layer in self.lora_layers().values():
            if not layer.merged:
                layer.merge()
        self.is_lora_merged = True

    def unmerge_lora(self) -> None:
        """Undo :meth:`merge_lora`."""
        for layer in self.lora_layers().values():
            if layer.merged:
                layer.unmerge()
        self.is_lora_merged = False

    def get_base_model(self) -> nn.Module:
        return self.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Attributes this wrapper lacks come from the wrapped model (``config``, ``generate``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    # State dicts ---------------------------------------------------------------------------
    def original_name(self, name: str) -> str:
        """``x.q_proj.base_layer.weight`` -> ``x.q_proj.weight`` (the unwrapped model's name)."""
        for lora_name in self.lora_module_names:
            if name.startswith(lora_name + _BASE):
                return lora_name + "." + name[len(lora_name + _BASE) :]
        return name

    def wrapped_name(self, name: str) -> str:
        """Inverse of :meth:`original_name` for base parameters of LoRA layers."""
        owner, _, leaf = name.rpartition(".")
        if owner in self.lora_module_names and not leaf.startswith(self.prefix):
            return f"{owner}.base_layer.{leaf}"
        return name

    def is_adapter_key(self, name: str) -> bool:
        """Whether ``name`` is a tensor of an adapter (``<LoRA module>.lora_*``)."""
        owner, _, rest = name.rpartition(f".{self.prefix}")
        return bool(rest) and owner in self.lora_module_names

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Adapter, ``bias``-mode biases and ``modules_to_save`` (local shards, nxd names)."""
        out = {}
        params = dict(self.module.named_parameters())
        for name, tensor in self.module.state_dict().items():
            if self.is_adapter_key(name) or (name in params and self.is_trainable_name(name)):
                out[self.original_name(name)] = tensor
        return out

    def base_state_dict(self, *, merged: bool = False) -> dict[str, torch.Tensor]:
        """The base model's state under its original names (``W + s·BA`` when ``merged``)."""
        out = {
            self.original_name(name): tensor
            for name, tensor in self.module.state_dict().items()
            if not self.is_adapter_key(name)
        }
        if merged and not self.is_lora_merged:
            for lora_name, layer in self.lora_layers().items():
                for param_name, weight in layer.merged_base_weights().items():
                    out[f"{lora_name}.{param_name}"] = weight
        return out

    # Checkpoint state (nxd_state.shards' protocol; nxd-ckpt reads it) -------------------------
    def checkpoint_tensors(self, ctx: RankContext, *, for_load: bool = False) -> CheckpointTensors:
        """What the save mode stores, sharded (:mod:`nxd_lora.checkpoint_state`)."""
        return lora_checkpoint_tensors(self, ctx, for_load=for_load)

    def checkpoint_metadata(self) -> dict[str, Any]:
        """The index's ``lora`` entry: save mode, config fields, PEFT names."""
        return lora_checkpoint_metadata(self)

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "", **kwargs: Any
    ) -> dict[str, Any]:
        """What the save mode asks for (NxD): adapter; base + adapter; or the merged base.

        With ``merge_sharded_lora`` the full (TP-gathered) adapter: a collective over TP.
        """
        mode = self.lora_config.save_mode
        if self.lora_config.merge_sharded_lora:
            from nxd_lora.adapter import gather_full_adapter_state_dict

            state = gather_full_adapter_state_dict(self)
        elif mode == "adapter":
            state = self.adapter_state_dict()
        elif mode == "base_and_adapter":
            state = {**self.base_state_dict(), **self.adapter_state_dict()}
        else:
            state = self.base_state_dict(merged=True)
        out = destination if destination is not None else {}
        for name, tensor in state.items():
            out[prefix + name] = tensor
        return out

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any] | None = None,
        strict: bool = True,
        assign: bool = False,
        *,
        lora_ckpt: Mapping[str, Any] | None = None,
    ) -> nn.modules.module._IncompatibleKeys:
        """Load a :meth:`state_dict` of any save mode (base keys under original names), then,
        as NxD does, the pending adapter checkpoint.

        Two steps, NxD's: (1) ``state_dict`` (None: skipped; also skipped when the pending
        checkpoint came from disk with ``save_lora_base``, since it holds the base); (2) the
        adapter checkpoint: ``lora_ckpt`` when given, else ``self.lora_ckpt`` when
        ``lora_config.load_lora_from_ckpt`` (where NxD's loader leaves it).

        ``strict``: every key must name a parameter or buffer of this model, with the same
        shape, and every adapter tensor must be present (unless the dict is a merged base).
        The result lists the model's keys that neither dict held and every unexpected key.
        """
        pending = lora_ckpt
        if pending is None and self.lora_config.load_lora_from_ckpt:
            pending = self.lora_ckpt
        if state_dict is None and pending is None:
            raise ValueError(
                "LoraModel.load_state_dict: no state_dict and no pending adapter checkpoint "
                "(pass lora_ckpt=, or set model.lora_ckpt with lora_config.load_lora_from_ckpt)"
            )
        dicts: list[Mapping[str, Any]] = []
        base_in_pending = self.lora_config.save_lora_base and self.is_checkpoint_loaded
        if state_dict is not None and not (pending is not None and base_in_pending):
            dicts.append(state_dict)
        if pending is not None:
            dicts.append(pending)
        own = self.module.state_dict()
        for one in dicts:
            self._check_loadable(one, own, strict=strict)
        loaded: set[str] = set()
        unexpected: set[str] = set()
        for one in dicts:
            translated = {self.wrapped_name(k): v for k, v in one.items()}
            self.module.load_state_dict(
                {k: v for k, v in translated.items() if k in own}, strict=False, assign=assign
            )
            loaded.update(k for k in translated if k in own)
            unexpected.update(k for k in translated if k not in own)
        missing = [k for k in own if k not in loaded]
        return nn.modules.module._IncompatibleKeys(missing, sorted(unexpected))

    def _check_loadable(
        self, state_dict: Mapping[str, Any], own: Mapping[str, Any], *, strict: bool
    ) -> None:
        """Shapes always; with ``strict`` unknown keys and missing adapter tensors too."""
        translated = {self.wrapped_name(k): v for k, v in state_dict.items()}
        shape_errors = [
            f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
            for k, v in translated.items()
            if k in own and hasattr(v, "shape") and tuple(v.shape) != tuple(own[k].shape)
        ]
        if shape_errors:
            raise ValueError(
                "LoRA state dict does not match the model (check lora_rank and the TP degree): "
                + "; ".join(shape_errors[:6])
            )
        if not strict:
            return
        unexpected = sorted(k for k in translated if k not in own)
        has_adapter = any(self.is_adapter_key(k) for k in translated)
        missing_adapter = sorted(
            k for k in own if self.is_adapter_key(k) and k not in translated and has_adapter
        )
        if unexpected or missing_adapter:
            raise ValueError(
                f"LoRA state dict does not match the model: unexpected keys {unexpected[:8]}, "
                f"missing adapter keys {missing_adapter[:8]}"
            )

    def save_lora(self, save_dir: str | None = None, adapter_tag: str | None = None) -> None:
        """NxD's ``save_lora``: :func:`nxd_lora.save_lora` into ``save_dir/adapter_tag``."""
        from nxd_lora.checkpoint import save_lora

        save_lora(self, save_dir, adapter_tag)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped model's parameters under its own names (as NxD's LoRA model yields)."""
        yield from self.module.named_parameters(*args, **kwargs)

    # Reporting -------------------------------------------------------------------------------
    def named_adapter_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                yield name, param

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """``(trainable, total)`` parameter counts of this rank."""
        params = list(self.module.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        logger.info(
            "trainable params: %d || all params: %d || trainable%%: %.4f",
            trainable,
            total,
            100.0 * trainable / max(total, 1),
        )


LoRAModel = LoraModel  # the name NxD's API reference uses


def lora_requested(lora_config: LoraConfig | None, where: str) -> bool:
    """Whether ``lora_config`` applies LoRA: whenever it is a :class:`LoraConfig`, as in NxD's
    current code (its ``enable_lora`` is not consulted, so a ported script trains the same
    model as on NxD); anything else but None is an error naming ``where``."""
    if lora_config is None:
        return False
    if not isinstance(lora_config, LoraConfig):
        raise TypeError(
            f"{where}: lora_config must be an nxd_lora.LoraConfig, got {type(lora_config).__name__}"
        )
    return True


def get_lora_model(model: nn.Module, lora_config: LoraConfig | None) -> nn.Module:
    """NxD's ``get_lora_model``: ``model`` wrapped in :class:`LoraModel` whenever a
    ``lora_config`` is given (``None``: ``model`` itself), whatever its ``enable_lora`` says
    (see :func:`lora_requested`)."""
    if not lora_requested(lora_config, "get_lora_model"):
        return model
    if isinstance(model, LoraModel):
        raise ValueError("get_lora_model: the model already is a LoraModel; wrap it only once")
    assert lora_config is not None
    return LoraModel(model, lora_config)
