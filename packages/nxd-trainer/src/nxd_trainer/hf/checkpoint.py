"""Sharded checkpoints of parallelised Hugging Face models, and export back to a HF folder.

``save_model_sharded_checkpoint`` writes the nxd-ckpt format (safetensors + a JSON index with
every tensor's global shape and how each rank's piece maps into it; no pickle), so the
checkpoint loads at any TP/PP/DP degrees: ``load_model_sharded_checkpoint``, or
``parallelize(checkpoint_dir=...)``. :func:`export_hf` assembles the full tensors one by one
into a folder ``transformers``' ``from_pretrained`` and ``generate`` use: the original names
(the GQA projection stores its tensors as ``q_proj/k_proj/v_proj``, K/V replicas once; older
checkpoints' ``weight_q/k/v`` are renamed), ``config.json`` with ``use_cache: true`` and the
model class in ``architectures``, and ``generation_config.json`` with the special token ids,
which must agree with the tokenizer's (:func:`nxd_ckpt.export_hf`). Mixtral's, Qwen2-MoE's and
Qwen3-MoE's packed experts are written per expert, as ``save_pretrained`` writes them
(:mod:`nxd_trainer.hf._expert_export`); a checkpoint saved at expert parallelism > 1 holds
every expert (nxd-ckpt stores the all-experts tensor), so it exports like any other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxd_trainer.hf._expert_export import PER_EXPERT, write_experts_per_expert

__all__ = ["export_hf", "load_model_sharded_checkpoint", "save_model_sharded_checkpoint"]

logger = logging.getLogger(__name__)


def save_model_sharded_checkpoint(
    model: nn.Module,
    output_dir: str | Path,
    optimizer: torch.optim.Optimizer | None = None,
    use_xser: bool = True,
    async_save: bool = False,
    num_local_ranks_per_step: int = 8,
) -> None:
    """Save ``model`` (and ``optimizer``) into ``output_dir`` (collective). ``use_xser`` is
    accepted (the format writes tensor by tensor); ``num_local_ranks_per_step`` ranks of a
    host write at once (1-32)."""
    import nxd_ckpt

    workers = min(max(int(num_local_ranks_per_step), 1), 32)
    nxd_ckpt.save_checkpoint(
        output_dir,
        "",
        model=model,
        optimizer=optimizer,
        num_workers=workers,
        use_xser=use_xser,
        async_save=async_save,
    )


def load_model_sharded_checkpoint(model: nn.Module, load_dir: str | Path) -> None:
    """Load a checkpoint saved by :func:`save_model_sharded_checkpoint` (at any degrees)
    into the parallelised ``model`` (collective)."""
    import nxd_ckpt

    nxd_ckpt.load_checkpoint(load_dir, model=model, load_rng=False)


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
    from nxd_trainer.hf.manager import ParallelizersManager

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
