"""NxD's ``neuronx_distributed.utils.batch_utils``: label shifting and the context-parallel slice.

The context-parallel slice is the load-balanced (zigzag) one of Megatron and NxD: the sequence
cut into ``2 * CP`` chunks, rank ``r`` keeping chunks ``r`` and ``2 * CP - 1 - r``
(:mod:`nxd_layers.context_parallel.split`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["get_batch_on_this_context_parallel_rank", "shift_labels"]

IGNORE_INDEX = -100


def shift_labels(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``labels[:, t] <- labels[:, t + 1]``, the last position set to -100 (ignored by the loss);
    every other entry is passed through unchanged."""
    out = dict(batch)
    if "labels" in batch:
        labels = batch["labels"]
        if labels.dim() < 2:
            raise ValueError(
                f"labels must be (batch, sequence, ...), got shape {tuple(labels.shape)}"
            )
        pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
        out["labels"] = torch.cat([labels[:, 1:], pad], dim=1)
    return out


def get_batch_on_this_context_parallel_rank(
    batch: Mapping[str, torch.Tensor],
) -> Mapping[str, torch.Tensor]:
    """This rank's share of ``batch`` along the sequence (dimension 1 of every tensor): the
    whole batch at context-parallel size 1, else the zigzag slice; a sequence length that
    ``2 * CP`` does not divide is an error naming both."""
    from nxd_layers.context_parallel import split_for_context_parallel
    from nxd_state import parallel_state

    state = parallel_state.get_parallel_state()
    if state.context_parallel_size == 1:
        return batch
    return {
        key: split_for_context_parallel(value, state.context_parallel_group, dim=1)
        if isinstance(value, torch.Tensor) and value.dim() >= 2
        else value
        for key, value in batch.items()
    }
