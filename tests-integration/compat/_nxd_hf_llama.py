"""A tiny Hugging Face Llama written the way NxD's training examples write theirs
(``examples/training/llama/modeling_llama_nxd.py`` and the scripts using it), imported only
through ``neuronx_distributed``; our own rendition of the calls, not NxD's code.

What it keeps of the example's structure:

* ``LlamaForCausalLM`` / ``LlamaModel`` / ``LlamaDecoderLayer`` / ``LlamaAttention`` /
  ``LlamaMLP`` / ``LlamaRotaryEmbedding`` subclass ``transformers``' classes, with
  ``ParallelEmbedding`` (vocabulary-parallel), separate q/k/v ``ColumnParallelLinear``, a
  ``RowParallelLinear`` o_proj, gate and up fused in one ``ColumnParallelLinear(stride=2)``
  split locally, a ``RowParallelLinear`` down_proj and a vocabulary-parallel ``lm_head``;
* attention through a ``CoreAttention`` module (the class the examples checkpoint
  selectively), rotary embeddings applied with ``overrides.transformer_overrides``;
* the rotary tables computed in float64 inside ``torch.autocast(device_type=x.device.type,
  enabled=False)``, as the example's rotary subclass does;
* the loss from ``parallel_cross_entropy``, the mean over tokens whose label is not -100;
  ``config.return_dict=False`` (the pipeline examples) returns ``(loss, logits)``;
* ``init_weights(module, device)``: the example's ``param_init_fn`` — it replaces rotary
  embedding children by fresh ones (so tables left on ``meta`` by ``include_buffers=True`` are
  recomputed), sets norms to 1 and re-draws parallel layers with ``init_weight_cpu()``.

Loaded by path from the tests (this folder is not a package).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama import modeling_llama as hf

from neuronx_distributed.overrides.transformer_overrides import apply_rotary_pos_emb
from neuronx_distributed.parallel_layers.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
)
from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
from neuronx_distributed.parallel_layers.parallel_state import get_tensor_model_parallel_size

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, SEQ = 64, 32, 64, 4, 4, 2, 8


def tiny_config(**overrides: Any) -> LlamaConfig:
    """The example's ``LlamaConfig``, tiny."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        initializer_range=0.1,
        pad_token_id=0,
    )
    config.use_cache = False
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _init_normal(std: float, weight: torch.Tensor) -> torch.Tensor:
    return nn.init.normal_(weight, mean=0.0, std=std)


class LlamaRMSNorm(hf.LlamaRMSNorm):
    """HF's norm; its weight tagged ``sequence_parallel_enabled`` as the example does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel_enabled = False


class LlamaRotaryEmbedding(hf.LlamaRotaryEmbedding):
    """cos/sin of ``position * inv_freq`` in float64 with autocast off for the inputs' device
    (the example's override), cast to the activations' dtype."""

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        freqs_in = self.inv_freq[None, :, None].double().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].double()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (freqs_in @ positions).transpose(1, 2)  # (b, s, d/2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return (cos * self.attention_scaling).to(x.dtype), (sin * self.attention_scaling).to(
            x.dtype
        )


class LlamaMLP(hf.LlamaMLP):
    def __init__(self, config: LlamaConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.act_fn = hf.ACT2FN[config.hidden_act]
        init = partial(_init_normal, config.initializer_range)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            2 * config.intermediate_size,
            stride=2,
            bias=False,
            gather_output=False,
            init_method=init,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=False,
            input_is_parallel=True,
            init_method=init,
        )
        self.split_size = config.intermediate_size // get_tensor_model_parallel_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.split_size, dim=2)
        return self.down_proj(self.act_fn(gate) * up)


class CoreAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + causal mask) V, the softmax in float32."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq = q.shape[-2]
        scores = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])  # (b, h, s, s)
        causal = torch.triu(torch.ones(seq, seq, device=q.device), diagonal=1).bool()
        scores = scores.masked_fill(causal, -10000.0)
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class LlamaAttention(hf.LlamaAttention):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        init = partial(_init_normal, config.initializer_range)
        tp = get_tensor_model_parallel_size()
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        column = partial(ColumnParallelLinear, bias=False, gather_output=False, init_method=init)
        self.q_proj = column(config.hidden_size, q_size)
        self.k_proj = column(config.hidden_size, kv_size)
        self.v_proj = column(config.hidden_size, kv_size)
        self.o_proj = RowParallelLinear(
            q_size, config.hidden_size, bias=False, input_is_parallel=True, init_method=init
        )
        self.num_heads = config.num_attention_heads // tp
        self.num_key_value_heads = config.num_key_value_heads // tp
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.core_attn = CoreAttention()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin, None)
        k = hf.repeat_kv(k, self.num_key_value_groups)
        v = hf.repeat_kv(v, self.num_key_value_groups)
        out = self.core_attn(q, k, v).transpose(1, 2).reshape(b, s, -1)  # (b, s, h_local * d)
        return self.o_proj(out), None


class LlamaDecoderLayer(hf.LlamaDecoderLayer):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaModel(hf.LlamaModel):
    def __init__(self, config: LlamaConfig) -> None:
        hf.LlamaPreTrainedModel.__init__(self, config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        init = partial(_init_normal, config.initializer_range)
        self.embed_tokens = ParallelEmbedding(
            config.vocab_size, config.hidden_size, self.padding_idx, init_method=init
        )
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class LlamaForCausalLM(hf.LlamaForCausalLM):
    _tied_weights_keys: dict[str, str] = {}  # noqa: RUF012 - transformers' class attribute

    def __init__(self, config: LlamaConfig) -> None:
        hf.LlamaPreTrainedModel.__init__(self, config)
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            bias=False,
            gather_output=False,
            init_method=partial(_init_normal, config.initializer_range),
        )
        self.post_init()

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        kwargs.pop("use_cache", None)
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs
        )[0]
        logits = self.lm_head(hidden).float()  # (b, s, vocab / tp)
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1, :].contiguous().view(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].contiguous().view(-1)
            per_token = parallel_cross_entropy(shift_logits, shift_labels)
            valid = (shift_labels != -100).float()
            loss = (per_token * valid).sum() / valid.sum().clamp_min(1.0)
        if not self.config.return_dict:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def init_weights(module: nn.Module, device: torch.device) -> None:
    """The example's ``param_init_fn(module, device)``."""
    for key, child in module._modules.items():
        if isinstance(child, LlamaRotaryEmbedding):
            module._modules[key] = LlamaRotaryEmbedding(config=child.config)
    if isinstance(module, LlamaRMSNorm):
        module.weight.data.fill_(1.0)
    elif isinstance(module, (ParallelEmbedding, RowParallelLinear, ColumnParallelLinear)):
        module.init_weight_cpu()
        if getattr(module, "bias", None) is not None:
            module.bias.data.zero_()
