"""Model FLOPs per token, the card's peak and MFU (model FLOPs utilisation).

For a decoder-only LM of L layers, width h (= heads · head_dim), trained on sequences of s
tokens, one token costs, forward + backward (backward = 2 · forward)::

    F_palm   = 6·N + 12·L·h·s      (PaLM, appendix B: the attention scores QKᵀ and the
                                    weighted sum AV, 2·2·s·h multiply-adds per token per layer,
                                    forward + backward; the full s×s matrix, not halved for the
                                    causal mask, as Megatron and PaLM count it)
    F_causal = 6·N + 6·L·h·s       (the same with the causal half only: what flash attention
                                    actually computes)
    F_dense  = 6·N                 (matrix products of the weights alone)

N counts the parameters that take part in matrix products: every parameter except the input
embedding table (a lookup; the untied LM head is counted). Activation recomputation is never
counted (MFU, not hardware FLOPs utilisation). MFU = F · tokens/s / peak, with the peak the
card's dense bf16 tensor-core rate from its datasheet (no sparsity).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PEAK_BF16_TFLOPS", "count_parameters", "flops_per_token", "mfu", "peak_bf16_tflops"]

# Datasheet dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s, matched in this order against
# torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3" is the SXM part; the H200 is the
# same GH100 chip as the H100 SXM, with more and faster memory: same peak).
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.5),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100", 989.4),  # SXM5 (HBM3): "NVIDIA H100 80GB HBM3"
    ("H800", 989.4),
    ("A100", 312.0),
]


def peak_bf16_tflops(device_name: str) -> tuple[float | None, str]:
    """The datasheet peak for ``device_name`` and the table entry it matched (None: unknown)."""
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value, key
    return None, "unknown card: pass --peak-tflops"


def count_parameters(config: Any) -> dict[str, int]:
    """Parameters of ``LlamaForCausalLM(config)`` counted on the meta device (no memory):
    ``total``, ``embedding`` (the input table) and ``matmul`` = total - embedding."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    if config.tie_word_embeddings:  # the table is the LM head too: a matrix product
        embedding = 0
    return {"total": total, "embedding": embedding, "matmul": total - embedding}


def flops_per_token(n_matmul: int, layers: int, width: int, seq: int) -> dict[str, float]:
    """``palm``, ``causal`` and ``dense`` FLOPs per trained token (module docstring)."""
    dense = 6.0 * n_matmul
    return {
        "palm": dense + 12.0 * layers * width * seq,
        "causal": dense + 6.0 * layers * width * seq,
        "dense": dense,
    }


def mfu(flops: dict[str, float], tokens_per_s: float | None, peak_tflops: float | None) -> Any:
    """MFU under each count of ``flops`` (None without a rate or a peak)."""
    if not tokens_per_s or not peak_tflops:
        return None
    return {k: v * tokens_per_s / (peak_tflops * 1e12) for k, v in flops.items()}
