"""Sharded checkpoints of parallelised Hugging Face models (export: :mod:`nxd_trainer.hf.export`).

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

import torch
from torch import nn

__all__ = ["load_model_sharded_checkpoint", "save_model_sharded_checkpoint"]

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
