"""What the wrapper remembers of the user's model, and the Hugging Face conventions it reads.

Under pipeline parallelism the original module is not kept (with eager init it would pin the
other stages' weights in memory), only this small record: its class, and for Hugging Face
models the ``config``, ``name_or_path`` and ``dtype`` NxD's wrapper exposes. ``transformers``
is never imported here: a model is a Hugging Face model if ``transformers`` is already loaded
and the model is a ``PreTrainedModel``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModelInfo", "is_hf_model", "no_split_classes", "resolve_classes"]


def is_hf_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def no_split_classes(model: nn.Module) -> tuple[type, ...]:
    """The classes a Hugging Face model names in ``_no_split_modules`` (its layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: dict[str, type] = {}
    for module in model.modules():
        if type(module).__name__ in names:
            found.setdefault(type(module).__name__, type(module))
    return tuple(found.values())


def resolve_classes(key: str, values: Iterable[type | str], model: nn.Module) -> tuple[type, ...]:
    """Classes, with class names looked up among ``model``'s module types (NxD accepts
    ``LlamaRMSNorm.__name__``); a name that matches no module is an error naming ``key``."""
    by_name: dict[str, type] = {}
    for module in model.modules():
        by_name.setdefault(type(module).__name__, type(module))
    out = []
    for value in values:
        if isinstance(value, str):
            if value not in by_name:
                raise ValueError(
                    f"{key}: no module of the model has class name {value!r}; the model's "
                    f"module classes are {sorted(by_name)[:20]}"
                )
            out.append(by_name[value])
        else:
            out.append(value)
    return tuple(out)


@dataclass(frozen=True)
class ModelInfo:
    """The user's model, as far as the wrapper needs it after wrapping."""

    class_name: str
    is_hf: bool
    hf_config: Any
    name_or_path: str | None
    dtype: torch.dtype | None
    layer_classes: tuple[type, ...]

    @classmethod
    def of(cls, model: nn.Module) -> ModelInfo:
        hf = is_hf_model(model)
        return cls(
            class_name=type(model).__name__,
            is_hf=hf,
            hf_config=getattr(model, "config", None) if hf else None,
            name_or_path=getattr(model, "name_or_path", None) if hf else None,
            dtype=getattr(model, "dtype", None) if hf else None,
            layer_classes=no_split_classes(model) if hf else (),
        )
