"""Shared test setup: forkserver preloads and the tiny Hugging Face Llama the tests save."""

from pathlib import Path

import pytest
import torch

from nxd_state.testing import add_preload, pin_cpu_test

add_preload("nxd_lora", "transformers.models.llama.modeling_llama")


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    """A randomly initialised 2-layer GQA Llama (seed 0) saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    path = tmp_path / "base"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    pin_cpu_test(request.node, monkeypatch.setenv)  # CPU tests wherever they run
