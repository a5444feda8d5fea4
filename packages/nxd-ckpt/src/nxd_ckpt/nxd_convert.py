"""Convert NxD's own checkpoint layout into this package's format, without a model.

NxD records no sharding, so the partition dim of each tensor comes from name rules (default:
:data:`LLAMA_RULES`); the TP shards of each pipeline stage are concatenated along it and the
whole tensors saved with :func:`~nxd_ckpt.save_checkpoint` (loadable at any degrees). Reading a
tag into a model, with the model's own sharding attributes, is :mod:`nxd_ckpt.nxd_format`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from nxd_ckpt.checkpoint import save_checkpoint
from nxd_ckpt.format import _tags
from nxd_ckpt.format._nxd_files import is_nxd_checkpoint, scan
from nxd_ckpt.nxd_format import _pickled, torch_load_safe

__all__ = ["LLAMA_RULES", "convert_nxd_checkpoint", "load_rules"]

logger = logging.getLogger(__name__)

LLAMA_RULES: list[tuple[str, int]] = [
    (r"(embed_tokens|lm_head|q_proj|k_proj|v_proj|gate_proj|up_proj|qkv_proj)\.(weight|bias)$", 0),
    (r"(o_proj|down_proj)\.weight$", 1),
]
"""Partition dims of a Llama-family model by parameter name (others are replicated)."""


def load_rules(
    rules: str | os.PathLike[str] | list[tuple[str, int]] | None,
) -> list[tuple[str, int]]:
    """Name rules: ``"llama"``, a JSON file of ``[regex, dim]`` pairs, or the list itself."""
    if rules is None or rules == "llama":
        return LLAMA_RULES
    if isinstance(rules, list):
        return rules
    return [(pattern, int(dim)) for pattern, dim in json.loads(Path(rules).read_text())]


def _rule_dim(name: str, rules: list[tuple[str, int]]) -> int | None:
    """The partition dim of ``name`` by the first matching rule (None: replicated)."""
    return next((dim for pattern, dim in rules if re.search(pattern, name)), None)


def convert_nxd_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
    rules: list[tuple[str, int]] | None = None,
    allow_pickle: bool = False,
) -> Path:
    """Convert the model of an NxD-layout tag into this format (global tensors, loadable at
    any degrees), partition dims from name ``rules`` (default: Llama's). One process."""
    root = Path(source)
    tag_dir = root if is_nxd_checkpoint(root) else _tags.resolve_tag_dir(root, tag)[0]
    files = {(tp, pp): p for (dp, tp, pp), p in scan(tag_dir / "model").items() if dp == 0}
    if not files:
        raise FileNotFoundError(f"{tag_dir} is not an NxD checkpoint (no model/*.pt files)")
    size = max(tp for tp, _ in files) + 1
    rules = load_rules(rules)
    full: dict[str, torch.Tensor] = {}
    for pp in sorted({pp for _, pp in files}):
        shards = [torch_load_safe(files[(t, pp)]) for t in range(size)]
        for name in shards[0]:
            dim = _rule_dim(name, rules)
            parts = [shard[name] for shard in shards]
            full[name] = parts[0] if dim is None else torch.cat(parts, dim=dim)
    content = _pickled(tag_dir, "user_content.pt", allow_pickle) if allow_pickle else None
    out = Path(destination)
    name = out_tag if out_tag is not None else tag_dir.name
    save_checkpoint(out, name, model=full, user_content=content)
    logger.info("converted %s (TP=%d) to %s/%s: %d tensors", tag_dir, size, out, name, len(full))
    return out / name
