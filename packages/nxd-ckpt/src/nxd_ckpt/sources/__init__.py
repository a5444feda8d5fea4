"""Helpers of the sources other than nxd-ckpt's own tags.

The sources themselves are the public modules :mod:`nxd_ckpt.nxd_format` (NxD's pickled
layout), :mod:`nxd_ckpt.hf` (Hugging Face folders), :mod:`nxd_ckpt.legacy` (NxD's legacy
``parallel_layers.save``) and :mod:`nxd_ckpt.nxd_convert`; each turns its files into an
index and reads it through :mod:`nxd_ckpt.load`. Here: ``_nxd_layout`` (how a tensor of an
NxD per-rank file maps into the global tensor) and ``_hf_config`` (an export's
``config.json`` and ``generation_config.json``).

Internal: nothing here is public API.
"""

__all__: list[str] = []
