"""Preload the heavy imports the multi-rank tests use into the rank forkserver."""

from nxd_state.testing import add_preload

add_preload("nxd_lora", "transformers.models.llama.modeling_llama")
