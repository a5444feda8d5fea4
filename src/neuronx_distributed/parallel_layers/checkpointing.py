"""NxD's ``neuronx_distributed.parallel_layers.checkpointing``: the legacy ``save``/``load``
(``tp_rank_XX_pp_rank_YY`` folders), written as safetensors by :mod:`nxd_ckpt.legacy`."""

from nxd_ckpt.legacy import load, save

__all__ = ["load", "save"]
