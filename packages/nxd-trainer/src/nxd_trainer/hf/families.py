"""The supported families: one spec and one parallelizer class each.

Llama, Mistral and Qwen2 share Llama's module names (Qwen2 adds Q/K/V biases, which the swap
finds on the modules); Qwen3 adds per-head RMSNorms on Q and K. A new family whose layers use
these names is two lines here and one entry in :class:`~nxd_trainer.hf.ParallelizersManager`.
"""

from __future__ import annotations

from nxd_trainer.hf.parallelizer import Parallelizer
from nxd_trainer.hf.spec import ModelSpec

__all__ = [
    "LlamaParallelizer",
    "MistralParallelizer",
    "Qwen2Parallelizer",
    "Qwen3Parallelizer",
]

LLAMA = ModelSpec(model_type="llama")
MISTRAL = ModelSpec(model_type="mistral")
QWEN2 = ModelSpec(model_type="qwen2")
QWEN3 = ModelSpec(model_type="qwen3", qk_norms=("q_norm", "k_norm"))


class LlamaParallelizer(Parallelizer):
    spec = LLAMA


class MistralParallelizer(Parallelizer):
    spec = MISTRAL


class Qwen2Parallelizer(Parallelizer):
    spec = QWEN2


class Qwen3Parallelizer(Parallelizer):
    spec = QWEN3
