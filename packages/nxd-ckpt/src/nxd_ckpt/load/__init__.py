"""The one load pipeline: plan the reads, read and check the boxes, then restore.

``_load`` is one load of an nxd-ckpt tag, top to bottom (match, check and read, apply).

Every source is read through a :class:`~nxd_ckpt.load._reader.CheckpointReader` (an index
and the files its chunks name: nxd-ckpt's own tags, or an index built in memory for NxD's
files, Hugging Face folders and legacy files). ``_load_model`` and ``_optim_load`` plan the
boxes a model and an optimizer need (``model_reads`` / ``optimizer_reads``) and copy them in;
``_preflight`` reads and checks every box before the first copy and agrees on the result
across ranks; ``_restore`` puts the scheduler back if a later step fails.

Internal: the public entry points are :func:`nxd_ckpt.load_checkpoint` and the source
modules (:mod:`nxd_ckpt.hf`, :mod:`nxd_ckpt.nxd_format`, :mod:`nxd_ckpt.legacy`, ...).
"""

__all__: list[str] = []
