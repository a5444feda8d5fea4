"""NxD's ``neuronx_distributed.modules``: ``qkv_linear``, ``lora`` and ``moe``."""
