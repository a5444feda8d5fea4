"""The attention forward of a parallelised Hugging Face model: local heads, any sequence split.

On TP rank r the Q projection yields the heads ``[r·h/t, (r+1)·h/t)`` and K/V their KV heads
(replicated ones under GQA with ``kv_size_multiplier``), so attention is the unsharded
model's on those heads::

    Q, K, V = X W_q^T, X W_k^T, X W_v^T           # (B, S, n_local·d) each
    Q, K = rope(norm_q(Q)), rope(norm_k(K))       # per head, where the family has the norms
    O = softmax(Q K^T · d^-1/2 + mask) V          # K/V heads shared by n_q / n_kv local Q heads
    Y = O W_o^T                                   # row-parallel: summed over TP

Hugging Face's forward reshapes with the *input's* sequence length, which under sequence
parallelism is the local slice ``S/t`` while Q/K/V (gathered by the column-parallel projection)
span the whole sequence; and it calls ``q_proj`` / ``k_proj`` / ``v_proj`` separately, while
the GQA projection is one module. So the attention class is swapped for a subclass with this
forward (same module, same parameters, names unchanged); rotary embedding and the attention
kernels (eager, SDPA ...) are the family's own functions. Dropout on attention probabilities
draws from the TP-distinct RNG stream (each rank holds other heads). Q/K norm weights are
shared by all heads: each rank's gradient is the part of its heads, summed over TP in backward.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn

import nxd_state
from nxd_trainer.hf._capture import capturing, stand_in

__all__ = ["ParallelAttentionMixin", "parallel_attention_class"]

_CLASSES: dict[type, type] = {}


class ParallelAttentionMixin:
    """The forward above; the swap sets ``_nxd_qkv`` (``("qkv_proj",)`` for the GQA
    projection, else the Q, K, V names), ``_nxd_o``, ``_nxd_qk_norms`` and
    ``num_key_value_groups`` (local Q heads per local KV head)."""

    _nxd_family: str
    _nxd_qkv: tuple[str, ...]
    _nxd_o: str
    _nxd_qk_norms: tuple[str, ...]

    def _nxd_project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self._nxd_qkv) == 1:
            return getattr(self, self._nxd_qkv[0])(hidden_states)
        return tuple(getattr(self, name)(hidden_states) for name in self._nxd_qkv)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        family = sys.modules[self._nxd_family]  # the modeling module of the original class
        head_dim = self.head_dim  # type: ignore[attr-defined]
        q, k, v = self._nxd_project(hidden_states)
        b, s = q.shape[0], q.shape[1]  # the whole sequence, gathered under SP
        q = q.view(b, s, -1, head_dim)  # (B, S, nh_local, hd)
        k = k.view(b, s, -1, head_dim)  # (B, S, nkv_local, hd)
        v = v.view(b, s, -1, head_dim)
        if self._nxd_qk_norms:
            q = _head_norm(getattr(self, self._nxd_qk_norms[0]), q)
            k = _head_norm(getattr(self, self._nxd_qk_norms[1]), k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, n, S, hd)
        cos, sin = position_embeddings
        q, k = family.apply_rotary_pos_emb(q, k, cos, sin)
        algorithm = getattr(self, "_nxd_cp_algorithm", None)
        if algorithm is not None:
            if past_key_values is not None:
                raise ValueError(
                    "context parallelism trains on whole sequences: a KV cache "
                    "(past_key_values, use_cache=True) is not supported"
                )
            if capturing():  # a pipeline's capture: this layer runs as a call (hf._capture)
                out = stand_in(q).transpose(1, 2)
            else:
                out = self._nxd_context_parallel(q, k, v, algorithm)
            return getattr(self, self._nxd_o)(out.reshape(b, s, -1).contiguous()), None
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)  # type: ignore[attr-defined]
        config = self.config  # type: ignore[attr-defined]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            config._attn_implementation, family.eager_attention_forward
        )
        window = getattr(self, "sliding_window", getattr(config, "sliding_window", None))
        dropout = self.attention_dropout if self.training else 0.0  # type: ignore[attr-defined]
        fork = nxd_state.get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        with fork:
            out, weights = attention(
                self,
                q,
                k,
                v,
                attention_mask,
                dropout=dropout,
                scaling=self.scaling,  # type: ignore[attr-defined]
                sliding_window=window,
                **kwargs,
            )
        out = out.reshape(b, s, -1).contiguous()  # (B, S, nh_local·hd)
        return getattr(self, self._nxd_o)(out), weights

    def _nxd_context_parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, algorithm: str
    ) -> torch.Tensor:
        """Causal attention of this rank's tokens against the whole sequence, split over the
        context-parallel group (``nxd_trainer._context_parallel``); ``(B, S_local, n, hd)``.
        The attention mask is not read: the inputs were checked to hold no padding, and the
        causal mask is applied by global position inside the ring / all-to-all."""
        from nxd_layers.context_parallel import all_to_all_attention, ring_attention

        state = nxd_state.get_parallel_state()
        group, cp = state.context_parallel_group, state.context_parallel_size
        config = self.config  # type: ignore[attr-defined]
        window = getattr(self, "sliding_window", getattr(config, "sliding_window", None))
        seq_len = q.shape[2] * cp
        if window is not None and window < seq_len:
            raise ValueError(
                f"sliding_window={window} below the sequence length {seq_len}: context-parallel "
                f"attention is full causal attention; use sequences of at most {window} tokens"
            )
        scale = self.scaling  # type: ignore[attr-defined]
        if algorithm == "ring":
            out = ring_attention(q, k, v, group, causal=True, scale=scale)
        else:
            out = all_to_all_attention(q, k, v, group, causal=True, scale=scale, zigzag=False)
        return out.transpose(1, 2)


def _head_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` on this rank's heads with its weights entering through an identity whose
    backward sums over TP: every rank holds the norm's whole gradient (the sum of the heads'
    parts), whatever optimizer steps it."""
    from nxd_layers.mappings import copy_to_tensor_model_parallel_region

    weights = {n: copy_to_tensor_model_parallel_region(p) for n, p in norm.named_parameters()}
    return torch.func.functional_call(norm, weights, (x,))


def parallel_attention_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``Parallel<cls>``: ``cls`` with the forward above (one subclass per class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Parallel{cls.__name__}",
            (ParallelAttentionMixin, cls),
            {"_nxd_family": cls.__module__},
        )
    return _CLASSES[cls]
