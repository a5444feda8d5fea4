"""A tiny GPT-style causal LM in plain PyTorch, traceable by torch.fx: for tests and benchmarks.

``TinyGPT(vocab, hidden, layers, heads)``: token + position embeddings, pre-norm blocks
(causal self-attention ``softmax(QK^T/sqrt(d)) V`` and a GELU MLP), a final norm and a head
``logits = h W^T``, optionally tied to the token embedding (``W = E``). ``forward(input_ids,
labels)`` returns the mean next-token cross entropy.

With ``tensor_parallel=True`` the blocks use nxd's Megatron layout: Q, K, V and the MLP's first
projection are :class:`~nxd_layers.ColumnParallelLinear` (heads split over TP ranks), the
attention output and the MLP's second projection :class:`~nxd_layers.RowParallelLinear`.
:func:`copy_into_tensor_parallel` loads a plain model's weights into it, slice by slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "TinyGPT", "copy_into_tensor_parallel"]


def _linear(n_in: int, n_out: int, tensor_parallel: bool, kind: str) -> nn.Module:
    if not tensor_parallel:
        return nn.Linear(n_in, n_out)
    from nxd_layers import ColumnParallelLinear, RowParallelLinear

    if kind == "column":
        return ColumnParallelLinear(n_in, n_out, gather_output=False)
    return RowParallelLinear(n_in, n_out, input_is_parallel=True)


class Block(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)); attention is causal."""

    def __init__(self, hidden: int, heads: int, tensor_parallel: bool = False) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.head_dim = hidden // heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.q_proj = _linear(hidden, hidden, tensor_parallel, "column")
        self.k_proj = _linear(hidden, hidden, tensor_parallel, "column")
        self.v_proj = _linear(hidden, hidden, tensor_parallel, "column")
        self.o_proj = _linear(hidden, hidden, tensor_parallel, "row")
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = _linear(hidden, 4 * hidden, tensor_parallel, "column")
        self.out = _linear(4 * hidden, hidden, tensor_parallel, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln_1(x)
        q = self.q_proj(h)
        local = q.shape[-1]  # this TP rank's share of the hidden size (all of it without TP)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh_local, T, hs)
        k = self.k_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, local))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-shaped LM; ``tie_embeddings`` shares the head with the token embedding."""

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 4,
        heads: int = 4,
        max_positions: int = 16,
        tie_embeddings: bool = False,
        tensor_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_positions, hidden)
        self.h = nn.ModuleList(Block(hidden, heads, tensor_parallel) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        vocab = logits.shape[-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))


@torch.no_grad()
def copy_into_tensor_parallel(parallel: nn.Module, plain: nn.Module, rank: int, size: int) -> None:
    """Load ``plain``'s weights into ``parallel``: sharded parameters get this rank's slice."""
    source = dict(plain.named_parameters(remove_duplicate=False))
    for name, param in parallel.named_parameters():
        full: torch.Tensor = source[name]
        if getattr(param, "tensor_model_parallel", False):
            # partition_dim: set on its sharded parameters by nxd-layers (no typed attribute)
            full = full.chunk(size, dim=param.partition_dim)[rank]  # type: ignore[attr-defined]
        param.copy_(full)
