"""Which modules get LoRA: NxD's (and PEFT's) rule on dotted module names.

A list entry selects the module of exactly that name or whose name ends with ``"." + entry``
(``"q_proj"`` selects ``model.layers.0.self_attn.q_proj``, not ``...q_proj_extra`` nor the
module ``proj``); a single string is a regular expression the whole name must match. Only
modules whose type can carry LoRA are selected.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence

from torch import nn

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "default_target_modules",
    "match_modules",
    "peft_target_modules",
    "selects",
]

logger = logging.getLogger(__name__)

# Defaults by Hugging Face ``config.model_type`` (the attention projections, as in PEFT).
DEFAULT_TARGET_MODULES: dict[str, list[str]] = {
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
    "gpt_neox": ["query_key_value"],
    "bert": ["query", "value"],
}


def default_target_modules(model: nn.Module) -> list[str]:
    """The default keywords for ``model``'s ``config.model_type``, or a clear error."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_TARGET_MODULES:
        raise ValueError(
            f"target_modules is None and the model type {model_type!r} has no default; "
            f"set LoraConfig.target_modules (defaults exist for {sorted(DEFAULT_TARGET_MODULES)})"
        )
    return list(DEFAULT_TARGET_MODULES[model_type])


def selects(targets: Sequence[str] | str, name: str) -> bool:
    """Whether ``targets`` selects the module called ``name`` (see the module docstring)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == entry or name.endswith("." + entry) for entry in targets)


def match_modules(
    model: nn.Module, targets: Sequence[str] | str, supported: tuple[type, ...]
) -> list[str]:
    """Names of the modules of a ``supported`` type that ``targets`` selects.

    Raises when nothing matches, naming the targets and a few module names; logs list entries
    that matched nothing while others did.
    """
    names = [
        name
        for name, module in model.named_modules()
        if name and isinstance(module, supported) and selects(targets, name)
    ]
    if not names:
        candidates = [n for n, m in model.named_modules() if n and isinstance(m, supported)]
        raise ValueError(
            f"target_modules {targets!r} matched no module that LoRA supports (an entry selects "
            f"the module of that name or ending in '.<entry>'); supported modules of this model "
            f"include {candidates[:8]}"
        )
    if not isinstance(targets, str):
        unused = [entry for entry in targets if not any(selects([entry], n) for n in names)]
        if unused:
            logger.warning("target_modules entries %s matched no module", unused)
    # A module and its child both selected would wrap twice: refuse.
    nested = [(a, b) for a in names for b in names if b.startswith(a + ".")]
    if nested:
        raise ValueError(f"target_modules select nested modules {nested[:4]}; be more specific")
    return names


def peft_target_modules(
    targets: Sequence[str] | str, selected: Iterable[str], all_names: Iterable[str]
) -> list[str] | str:
    """``target_modules`` for PEFT's ``adapter_config.json`` selecting exactly ``selected``.

    PEFT applies the same rule as nxd, so ``targets`` is written as is when it selects the same
    modules among ``all_names`` (it may not when some selected modules could not carry LoRA);
    otherwise the selected names themselves are written.
    """
    wanted = set(selected)
    peft_selected = {name for name in all_names if selects(targets, name)}
    if peft_selected == wanted:
        return targets if isinstance(targets, str) else list(targets)
    return sorted(wanted)
