"""A tiny Llama written the way NxD's Llama example writes it, the same model in plain torch, and
NxD's rules for which rows or columns of a full tensor a TP rank holds.

The NxD-style model follows the structure of NxD's ``examples/training/llama`` modeling code:
``ParallelEmbedding(vocab, hidden, pad_token_id, init_method=..., sequence_parallel_enabled=...)``
with the padding index third and positional; attention through one
``GQAQKVColumnParallelLinear(..., kv_size_multiplier=...)`` and a ``RowParallelLinear`` o_proj;
the MLP as one ``ColumnParallelLinear(hidden, 2 * intermediate, stride=2)`` (gate and up fused,
split locally) and a ``RowParallelLinear`` down_proj; rotary embeddings from
``neuronx_distributed.overrides.transformer_overrides``; RMSNorm weights tagged
``sequence_parallel_enabled``; a vocab-parallel ``lm_head`` and ``parallel_cross_entropy``.
Under sequence parallelism activations are sequence-first, ``[s/tp, b, h]`` between the
TP regions and ``[s, b, ...]`` inside them, as NxD lays them out.

The reference is the same network on ``torch.nn`` layers, written independently (complex-number
rotary embedding, explicit KV-head indexing, ``F.cross_entropy``), holding the full weights.

Loaded by path from the tests (this folder is not a package).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import neuronx_distributed.parallel_layers.utils as neuronx_dist_utils
from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
from neuronx_distributed.overrides.transformer_overrides import apply_rotary_pos_emb
from neuronx_distributed.parallel_layers.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
)
from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
from neuronx_distributed.parallel_layers.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_size,
)
from nxd_state import collectives


@dataclass(frozen=True, kw_only=True)
class TinyLlamaConfig:
    """The few Llama settings the NxD example reads from its config."""

    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    kv_shared_group_size: int = 1
    """GQA's ``kv_size_multiplier``: KV-head replicas, so KV heads x replicas divide over TP."""
    sequence_parallel_enabled: bool = False
    pad_token_id: int = 0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.1
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def rotary_cos_sin(config: TinyLlamaConfig, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``cos``/``sin`` of shape ``(b, s, head_dim)``: angle ``pos * theta^(-2i/d)`` repeated for
    both halves, computed in float64 (as NxD's example does) and cast to float32."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = position_ids[..., None].double() * inv_freq  # (b, s, d/2)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float(), emb.sin().float()


def _init_normal(std: float, weight: torch.Tensor) -> torch.Tensor:
    return nn.init.normal_(weight, mean=0.0, std=std)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w; ``w`` is replicated over TP and, under sequence
    parallelism, sees only this rank's tokens (hence the tag)."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel_enabled: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.weight.sequence_parallel_enabled = sequence_parallel_enabled
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps))


class NxDMLP(nn.Module):
    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        init = partial(_init_normal, config.initializer_range)
        sp = config.sequence_parallel_enabled
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            2 * config.intermediate_size,
            stride=2,
            bias=False,
            gather_output=False,
            init_method=init,
            sequence_parallel_enabled=sp,
            keep_master_weight=True,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=False,
            input_is_parallel=True,
            init_method=init,
            sequence_parallel_enabled=sp,
            keep_master_weight=True,
        )
        self.split_size = config.intermediate_size // get_tensor_model_parallel_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.split_size, dim=2)
        return self.down_proj(F.silu(gate) * up)


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, n_kv, s, d) -> (b, n_kv * groups, s, d), each KV head repeated ``groups`` times."""
    b, n_kv, s, d = states.shape
    return states[:, :, None].expand(b, n_kv, groups, s, d).reshape(b, n_kv * groups, s, d)


class NxDAttention(nn.Module):
    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = config
        init = partial(_init_normal, config.initializer_range)
        sp = config.sequence_parallel_enabled
        heads, kv_heads, head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.qkv_proj = GQAQKVColumnParallelLinear(
            config.hidden_size,
            [heads * head_dim, kv_heads * head_dim],
            bias=False,
            gather_output=False,
            init_method=init,
            sequence_parallel_enabled=sp,
            kv_size_multiplier=config.kv_shared_group_size,
            keep_master_weight=True,
        )
        self.o_proj = RowParallelLinear(
            heads * head_dim,
            config.hidden_size,
            bias=False,
            input_is_parallel=True,
            init_method=init,
            sequence_parallel_enabled=sp,
            keep_master_weight=True,
        )
        tp = get_tensor_model_parallel_size()
        self.head_dim = head_dim
        self.num_heads = neuronx_dist_utils.divide(heads, tp)
        self.num_key_value_heads = neuronx_dist_utils.divide(
            kv_heads * config.kv_shared_group_size, tp
        )
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.local_hidden = config.hidden_size // tp

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        sp = self.config.sequence_parallel_enabled
        if sp:
            q_len, bsz, _ = hidden.size()
            q_len *= get_tensor_model_parallel_size()
        else:
            bsz, q_len, _ = hidden.size()
        q, k, v = self.qkv_proj(hidden)

        def heads_first(states: torch.Tensor, n: int) -> torch.Tensor:
            if sp:  # [s, b, n * d] -> [b, n, s, d]
                return states.view(q_len, bsz, n, self.head_dim).permute(1, 2, 0, 3)
            return states.view(bsz, q_len, n, self.head_dim).transpose(1, 2)

        q = heads_first(q, self.num_heads)
        k = heads_first(k, self.num_key_value_heads)
        v = heads_first(v, self.num_key_value_heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, None, False, False)
        k = _repeat_kv(k, self.num_key_value_groups)
        v = _repeat_kv(v, self.num_key_value_groups)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        causal = torch.triu(torch.ones(q_len, q_len, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(causal, -10000.0)  # NxD's CoreAttention mask value
        out = F.softmax(scores, dim=-1, dtype=torch.float32) @ v  # (b, n, s, d)
        if sp:
            out = out.permute(2, 0, 1, 3).reshape(q_len, bsz, self.local_hidden)
        else:
            out = out.transpose(1, 2).reshape(bsz, q_len, self.local_hidden)
        return self.o_proj(out)


class NxDDecoderLayer(nn.Module):
    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        sp = config.sequence_parallel_enabled
        self.self_attn = NxDAttention(config)
        self.mlp = NxDMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, sp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, sp)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class NxDTinyLlama(nn.Module):
    """Embedding, decoder layers, final norm, vocab-parallel head and parallel cross entropy."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = config
        init = partial(_init_normal, config.initializer_range)
        sp = config.sequence_parallel_enabled
        self.embed_tokens = ParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            config.pad_token_id,  # positional, as NxD's Llama passes it
            init_method=init,
            sequence_parallel_enabled=sp,
        )
        self.layers = nn.ModuleList(
            [NxDDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, sp)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            bias=False,
            gather_output=False,
            init_method=init,
            sequence_parallel_enabled=sp,
            keep_master_weight=True,
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _, seq_length = input_ids.shape
        position_ids = torch.arange(seq_length).unsqueeze(0).view(-1, seq_length)
        cos, sin = rotary_cos_sin(self.config, position_ids)
        hidden = self.embed_tokens(input_ids)  # [s/tp, b, h] under SP
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        logits = self.lm_head(self.norm(hidden))
        if self.config.sequence_parallel_enabled:
            logits = logits.transpose(0, 1).contiguous()  # [s, b, v/tp] -> [b, s, v/tp]
        logits = logits.float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_logits = shift_logits.view(-1, shift_logits.size(-1))
        shift_labels = labels[..., 1:].contiguous().view(-1)
        per_token = parallel_cross_entropy(shift_logits, shift_labels)
        valid = (shift_labels != -100).float()
        return (per_token * valid).sum() / valid.sum().clamp_min(1.0)


# The reference: the same network on torch.nn layers --------------------------------------------
class ReferenceLlama(nn.Module):
    """Plain-torch Llama with standard GQA (query head j attends to KV head
    ``j // (heads / kv_heads)``), built from the full weights of an :class:`NxDTinyLlama`."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            layer = nn.Module()
            layer.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
            layer.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
            for name, (out_size, in_size) in {
                "q_proj": (q_size, c.hidden_size),
                "k_proj": (kv_size, c.hidden_size),
                "v_proj": (kv_size, c.hidden_size),
                "o_proj": (c.hidden_size, q_size),
                "gate_proj": (c.intermediate_size, c.hidden_size),
                "up_proj": (c.intermediate_size, c.hidden_size),
                "down_proj": (c.hidden_size, c.intermediate_size),
            }.items():
                setattr(layer, name, nn.Linear(in_size, out_size, bias=False))
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate feature pairs (i, i + d/2) by angle pos * theta^(-2i/d), as complex numbers."""
        _, _, s, d = x.shape
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq  # (s, d/2)
        rotation = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)
        pairs = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * rotation
        return torch.cat([pairs.real, pairs.imag], dim=-1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s = input_ids.shape
        group = c.num_attention_heads // c.num_key_value_heads
        kv_of_head = torch.arange(c.num_attention_heads) // group
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = self._rms(x, layer.input_layernorm)
            q = layer.q_proj(h).view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2)
            k = layer.k_proj(h).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            v = layer.v_proj(h).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            q, k = self._rope(q), self._rope(k)
            k, v = k[:, kv_of_head], v[:, kv_of_head]
            scores = (q @ k.transpose(2, 3) / math.sqrt(c.head_dim)).masked_fill(causal, -10000.0)
            attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
            x = x + layer.o_proj(attn)
            h = self._rms(x, layer.post_attention_layernorm)
            x = x + layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h))
        logits = self.lm_head(self._rms(x, self.norm))
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, c.vocab_size), labels[:, 1:].reshape(-1), ignore_index=-100
        )


@torch.no_grad()
def reference_from(model: NxDTinyLlama) -> ReferenceLlama:
    """The reference holding ``model``'s full weights: NxD's ``master_weight*`` of the linear
    layers (``keep_master_weight=True``), the embedding table all-gathered over TP."""
    c = model.config
    ref = ReferenceLlama(c)
    table = collectives.all_gather(
        model.embed_tokens.weight.detach(), group=get_tensor_model_parallel_group(), dim=0
    )
    ref.embed_tokens.weight.copy_(table)
    for mine, theirs in zip(ref.layers, model.layers):
        qkv = theirs.self_attn.qkv_proj
        mine.q_proj.weight.copy_(qkv.master_weight_q)
        mine.k_proj.weight.copy_(qkv.master_weight_k)
        mine.v_proj.weight.copy_(qkv.master_weight_v)
        mine.o_proj.weight.copy_(theirs.self_attn.o_proj.master_weight)
        gate, up = theirs.mlp.gate_up_proj.master_weight.chunk(2, dim=0)  # [gate; up]
        mine.gate_proj.weight.copy_(gate)
        mine.up_proj.weight.copy_(up)
        mine.down_proj.weight.copy_(theirs.mlp.down_proj.master_weight)
        mine.input_layernorm.copy_(theirs.input_layernorm.weight)
        mine.post_attention_layernorm.copy_(theirs.post_attention_layernorm.weight)
    ref.norm.copy_(model.norm.weight)
    ref.lm_head.weight.copy_(model.lm_head.master_weight)
    return ref


# NxD's per-rank layout of a full tensor ---------------------------------------------------------
def nxd_shard(full: torch.Tensor, dim: int, rank: int, tp: int, stride: int = 1) -> torch.Tensor:
    """NxD's ``create_local_weight``: cut ``full`` along ``dim`` into ``tp * stride`` equal
    chunks; rank r holds chunks r, r + tp, r + 2 tp, ... concatenated."""
    chunks = full.chunk(tp * stride, dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim)


def replicated_kv(full: torch.Tensor, kv_heads: int, multiplier: int) -> torch.Tensor:
    """K/V rows with every KV head repeated ``multiplier`` times in place (head h's rows, then
    its copies): the layout nxd's GQA layer shards over TP. NxD repeats the whole block
    instead (``full.repeat(multiplier, 1)``); test_layer_semantics.py pins that difference."""
    heads = full.reshape(kv_heads, -1, *full.shape[1:])
    return heads.repeat_interleave(multiplier, dim=0).reshape(-1, *full.shape[1:])


def expected_local_grads(
    model: NxDTinyLlama, ref: ReferenceLlama, rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """This rank's share of every reference gradient, under the NxD model's parameter names."""
    c = model.config
    out = {"embed_tokens.weight": nxd_shard(ref.embed_tokens.weight.grad, 0, rank, tp)}
    for i, layer in enumerate(ref.layers):
        p = f"layers.{i}."
        out[p + "self_attn.qkv_proj.weight_q"] = nxd_shard(layer.q_proj.weight.grad, 0, rank, tp)
        for part in "kv":
            grad = getattr(layer, f"{part}_proj").weight.grad
            grad = replicated_kv(grad, c.num_key_value_heads, c.kv_shared_group_size)
            out[p + f"self_attn.qkv_proj.weight_{part}"] = nxd_shard(grad, 0, rank, tp)
        out[p + "self_attn.o_proj.weight"] = nxd_shard(layer.o_proj.weight.grad, 1, rank, tp)
        gate_up = torch.cat([layer.gate_proj.weight.grad, layer.up_proj.weight.grad])
        out[p + "mlp.gate_up_proj.weight"] = nxd_shard(gate_up, 0, rank, tp, stride=2)
        out[p + "mlp.down_proj.weight"] = nxd_shard(layer.down_proj.weight.grad, 1, rank, tp)
        out[p + "input_layernorm.weight"] = layer.input_layernorm.grad
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.grad
    out["norm.weight"] = ref.norm.grad
    out["lm_head.weight"] = nxd_shard(ref.lm_head.weight.grad, 0, rank, tp)
    return out
