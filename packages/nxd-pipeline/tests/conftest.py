"""Ranks fork from a forkserver that already imported the Llama model code (slow to import)."""

from nxd_state.testing import add_preload

add_preload("transformers.models.llama.modeling_llama", "nxd_pipeline.testing")
