"""Top-k with deterministic ties: among equal scores the lower expert index wins.

``torch.topk`` does not specify which of equal elements it returns; a stable descending sort
does (equal elements keep their index order), so routing never depends on the kernel.
"""

from __future__ import annotations

import torch

__all__ = ["stable_top_k"]


def stable_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of the ``k`` largest ``scores`` along the last dim, largest first;
    ties go to the lower index."""
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    return order[..., :k]
