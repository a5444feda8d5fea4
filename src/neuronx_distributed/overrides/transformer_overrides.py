"""NxD's ``neuronx_distributed.overrides.transformer_overrides``: rotary embeddings.

Rotary position embedding, per position ``t`` and pair of features ``(x_i, x_{i+d/2})``:

    RoPE(x)_t = x_t · cos_t + rotate_half(x_t) · sin_t,   rotate_half([x1, x2]) = [-x2, x1]

NxD's flash-attention kernels take ``q``/``k`` transposed to ``(batch, heads, head_dim, seq)``;
``flash_attn=True`` with ``transpose_nki_inputs=True`` applies the same rotation in that layout.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary_pos_emb", "rotate_half"]


def rotate_half(x: torch.Tensor, flash_attn: bool = False, transpose: bool = True) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` along the feature dim (dim -2 in the transposed layout)."""
    dim = -2 if flash_attn and transpose else -1
    first, second = x.chunk(2, dim=dim)
    return torch.cat((-second, first), dim=dim)


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    flash_attn: bool = False,
    transpose_nki_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RoPE(q), RoPE(k))`` for ``q``/``k`` of shape ``(b, heads, s, d)``.

    ``cos``/``sin``: a ``(max_pos, d)`` table indexed by ``position_ids`` ``(b, s)``, or already
    gathered as ``(b, s, d)`` when ``position_ids`` is None. With ``flash_attn`` and
    ``transpose_nki_inputs`` the inputs (and outputs) are ``(b, heads, d, s)``.
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, s, d): broadcast over heads
    transposed = flash_attn and transpose_nki_inputs
    if transposed:
        cos, sin = cos.transpose(-1, -2), sin.transpose(-1, -2)  # (b, 1, d, s)
    q_rotated = q * cos + rotate_half(q, flash_attn, transpose_nki_inputs) * sin
    k_rotated = k * cos + rotate_half(k, flash_attn, transpose_nki_inputs) * sin
    return q_rotated, k_rotated
