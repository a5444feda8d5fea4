"""Export a sharded checkpoint of a parallelised Hugging Face model as a Hugging Face folder.

:func:`export_hf` assembles the full tensors one by one into a folder ``transformers``'
``from_pretrained`` and ``generate`` use: the original names (the GQA projection stores its
tensors as ``q_proj/k_proj/v_proj``, K/V replicas once), ``config.json`` with ``use_cache: true``
and the model class in ``architectures``, and ``generation_config.json`` with the special token
ids, which must agree with the tokenizer's (:func:`nxd_ckpt.export_hf`). Mixtral's, Qwen2-MoE's
and Qwen3-MoE's packed experts are written per expert, as ``save_pretrained`` writes them
(:mod:`nxd_trainer.hf._expert_export`). The family's parallelizer (its tensor names) comes from
the registry, so this module sits above :mod:`nxd_trainer.hf.manager`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nxd_trainer.hf._expert_export import PER_EXPERT, write_experts_per_expert
from nxd_trainer.hf.manager import ParallelizersManager

__all__ = ["export_hf"]


def _tag_dir(root: Path, tag: str | None) -> Path:
    """The tag folder: ``root`` itself when it holds the index (and ``tag`` is None), else
    ``root/tag`` (a plain name, not a link) or the newest complete tag, as nxd-ckpt finds
    them (:func:`nxd_ckpt.hf.checkpoint_tag_dir`)."""
    from nxd_ckpt.hf import checkpoint_tag_dir

    return checkpoint_tag_dir(root, tag)


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    tag: str | None = None,
    tokenizer: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    config: Any = None,
    token_ids: dict[str, Any] | None = None,
) -> Path:
    """Write the model of a sharded checkpoint as a Hugging Face folder (one process; host
    memory near the largest tensor); returns ``out_dir``. ``tokenizer`` (a folder or an
    object with ``save_pretrained``) is written too, and its bos/eos/pad ids must agree with
    the saved config's: an error names both otherwise (``config=`` or ``token_ids=``, e.g.
    ``{"eos_token_id": 0}``, are written as given instead). A config saved without
    ``architectures`` gets the family's causal-LM class."""
    import nxd_ckpt

    tag_dir = _tag_dir(Path(checkpoint_dir), tag)
    index = nxd_ckpt.read_index(tag_dir)
    saved = index.hf_config
    if saved is None:
        raise ValueError(f"{tag_dir} holds no Hugging Face config: not a parallelised HF model")
    parallelizer = ParallelizersManager.parallelizer_for_model(saved["model_type"])
    spec = parallelizer.spec
    records = index.category("model")
    fused = [n for n in records if len(parallelizer.hf_names(n)) > 1]
    if fused:
        raise NotImplementedError(
            f"{tag_dir} stores fused QKV tensors under their own names ({fused[:2]}): it was "
            f"written before the GQA projection declared its stored names; load it into the "
            f"fused model and save it again to export it"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(saved["model_type"])
    for name in (f"{spec.embed_tokens}.weight", f"{spec.lm_head}.weight"):
        record = records.get(name)
        if record is not None and record.shape[0] != saved["vocab_size"]:
            raise NotImplementedError(
                f"{name} was saved padded to {record.shape[0]} rows (vocab_size "
                f"{saved['vocab_size']} is not divisible by the TP degree); nxd-ckpt stores "
                f"padded tensors as they are, so this export would not load in transformers"
            )
    out = nxd_ckpt.export_hf(
        tag_dir,
        out_dir,
        tokenizer=tokenizer,
        max_shard_size=max_shard_size,
        dtype=dtype,
        name_map=parallelizer.hf_name,
        config=config,
        token_ids=token_ids,
        architectures=[architecture] if architecture is not None else None,
    )
    if saved["model_type"] in PER_EXPERT:  # packed experts: per expert, as transformers writes
        write_experts_per_expert(out, saved["model_type"])
    return out
