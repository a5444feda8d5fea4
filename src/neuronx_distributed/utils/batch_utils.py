"""NxD's ``neuronx_distributed.utils.batch_utils``: label shifting and the context-parallel slice.

nxd runs with a context-parallel size of 1 (``initialize_model_parallel`` refuses more), so the
context-parallel slice of a batch is the batch itself.
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
    """This rank's share of ``batch`` along the sequence: the whole batch at context-parallel
    size 1, the only size nxd supports."""
    from nxd_state import parallel_state

    size = parallel_state.get_context_model_parallel_size()
    if size != 1:  # pragma: no cover - initialize_model_parallel refuses sizes > 1
        raise NotImplementedError(f"context parallel size {size} is not supported by nxd (only 1)")
    return batch
