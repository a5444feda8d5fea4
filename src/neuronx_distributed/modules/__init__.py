"""NxD's ``neuronx_distributed.modules``: ``qkv_linear`` and ``lora``."""
