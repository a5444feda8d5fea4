"""NxD's ``neuronx_distributed.overrides``: replacements for a few ``transformers`` functions."""
