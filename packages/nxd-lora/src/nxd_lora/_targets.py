"""Which modules get LoRA: keyword matching on dotted module names, as NxD documents it.

A module is a target when one of ``target_modules`` occurs in its dotted name
(``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``) and its type can carry LoRA.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from torch import nn

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "default_target_modules",
    "match_modules",
    "peft_target_modules",
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


def match_modules(
    model: nn.Module, keywords: Sequence[str], supported: tuple[type, ...]
) -> list[str]:
    """Names of the modules of a ``supported`` type whose dotted name contains a keyword.

    Raises when nothing matches, naming the keywords and a few module names; logs keywords
    that matched nothing while others did.
    """
    names = []
    used: set[str] = set()
    for name, module in model.named_modules():
        if not name or not isinstance(module, supported):
            continue
        hits = [keyword for keyword in keywords if keyword in name]
        if hits:
            names.append(name)
            used.update(hits)
    if not names:
        candidates = [n for n, m in model.named_modules() if n and isinstance(m, supported)]
        raise ValueError(
            f"target_modules {list(keywords)} matched no module that LoRA supports; "
            f"supported modules of this model include {candidates[:8]}"
        )
    unused = [keyword for keyword in keywords if keyword not in used]
    if unused:
        logger.warning("target_modules keywords %s matched no module", unused)
    # A match inside another match (e.g. "attn" on a module and its child) wraps both: refuse.
    nested = [(a, b) for a in names for b in names if b.startswith(a + ".")]
    if nested:
        raise ValueError(f"target_modules match nested modules {nested[:4]}; use narrower keywords")
    return names


def peft_target_modules(
    keywords: Sequence[str], targets: Iterable[str], all_names: Iterable[str]
) -> list[str]:
    """``target_modules`` for PEFT's ``adapter_config.json`` selecting exactly ``targets``.

    PEFT matches a list entry by exact name or ``name.endswith("." + entry)``. The keywords are
    written when that rule selects the same modules among ``all_names``; otherwise the target
    names themselves are written, so PEFT always adapts exactly the modules nxd adapted.
    """
    wanted = set(targets)
    peft_selected = {
        name
        for name in all_names
        if any(name == key or name.endswith("." + key) for key in keywords)
    }
    return list(keywords) if peft_selected == wanted else sorted(wanted)
