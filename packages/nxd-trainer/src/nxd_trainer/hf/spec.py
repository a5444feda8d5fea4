"""What to parallelise in a Hugging Face causal LM, as data: one :class:`ModelSpec` per family.

Megatron's split of a decoder layer, by module name: the attention projections Q, K, V and
the MLP's gate and up projections are column-parallel (``Y_i = X A_i``: each rank holds whole
heads / a slice of the intermediate features), the attention output and the MLP's down
projection are row-parallel (``Y = sum_i X_i A_i``), so one all-reduce ends each block. The
embedding is vocabulary-parallel and the LM head column-parallel over the vocabulary, the loss
computed on the sharded logits. Under sequence parallelism the norms run on a slice of the
sequence, so their weights are marked sequence-parallel (gradients summed over TP).

A family whose checkpoints use these names is one line: ``ModelSpec(model_type="llama")``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelSpec"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The module names of one Hugging Face causal-LM family (paths relative to the model,
    a decoder layer or its attention, as said per field)."""

    model_type: str
    """``config.model_type`` of the family (``"llama"``)."""

    layers: str = "model.layers"
    """The ``nn.ModuleList`` of decoder layers."""

    embed_tokens: str = "model.embed_tokens"
    """The token embedding (becomes ``ParallelEmbedding``)."""

    final_norm: str = "model.norm"
    """The norm after the last layer (sequence-parallel under SP)."""

    lm_head: str = "lm_head"
    """The output projection (column-parallel over the vocabulary)."""

    attention: str = "self_attn"
    """The attention module inside a decoder layer."""

    q_proj: str = "q_proj"
    """Query projection inside the attention module (column-parallel)."""

    k_proj: str = "k_proj"
    """Key projection (column-parallel, or the GQA QKV projection with Q and V)."""

    v_proj: str = "v_proj"
    """Value projection."""

    o_proj: str = "o_proj"
    """Attention output projection (row-parallel)."""

    qk_norms: tuple[str, ...] = ()
    """Per-head norms of Q and K inside the attention module (Qwen3: ``("q_norm",
    "k_norm")``): replicated over TP, each rank applies them to its own heads, so a gradient
    hook sums their partial gradients over TP."""

    mlp_column: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    """MLP input projections inside a decoder layer (column-parallel)."""

    mlp_row: tuple[str, ...] = ("mlp.down_proj",)
    """MLP output projection inside a decoder layer (row-parallel)."""

    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """Norms inside a decoder layer (sequence-parallel under SP)."""

    supports_sequence_parallel: bool = True
    """Whether SP may be used on top of TP for this family."""

    supports_pipeline_parallel: bool = True
    """Whether the family can be cut into pipeline stages (``tracer_cls="hf"``)."""
