"""Models and initialisers several pipeline test files share.

Not a test module (no ``test_`` prefix): test files load it with
``nxd_state.testing.load_sibling(__file__, "_models")``, because the rank processes find
functions by file and pytest's importlib mode does not put this folder on ``sys.path``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def tiny_llama(layers: int = 4) -> nn.Module:
    """An unmodified Hugging Face ``LlamaForCausalLM`` (GQA: 4 heads, 2 KV heads), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def deterministic_init(module: nn.Module) -> None:
    """Fills a module's own parameters from their shapes: same values on any device."""
    for name, param in module.named_parameters(recurse=False):
        values = torch.sin(torch.arange(param.numel(), dtype=torch.float32) * 0.37 + len(name))
        param.copy_(0.1 * values.reshape(param.shape))


def llama_init(module: nn.Module) -> None:
    """:func:`deterministic_init`, and the rotary table a meta model lacks (it is a buffer)."""
    deterministic_init(module)
    if hasattr(module, "inv_freq"):
        inv_freq, _ = module.compute_default_rope_parameters(module.config)
        module.register_buffer("inv_freq", inv_freq, persistent=False)


class Router(nn.Module):
    """A module whose ``route`` method torch.fx cannot trace (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.route(self.linear(x))

    def route(self, x: torch.Tensor) -> torch.Tensor:
        return -x if x.sum() > 0 else x


class RoutedNet(nn.Module):
    """Embedding -> :class:`Router` -> head, returning the cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.router = Router()
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.router(self.embed(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
