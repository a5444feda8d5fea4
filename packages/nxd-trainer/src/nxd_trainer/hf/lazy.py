"""Lazy loading for model parallelism: build a Hugging Face model without its big weights.

Inside ``lazy_load_for_parallelism(tensor_parallel_size, pipeline_parallel_size,
expert_parallel_size=...)`` (when any is > 1):

* every ``torch.nn.Linear`` and ``torch.nn.Embedding`` is created on the ``meta`` device:
  shapes, no memory;
* ``from_pretrained(folder)`` (on a model class or an ``AutoModel*`` class) builds the model
  from the folder's config that way and loads nothing: the folder is attached to the model,
  and :meth:`~nxd_trainer.hf.Parallelizer.parallelize` then reads each rank's rows/columns
  of each weight from its safetensors files (``safe_open(...).get_slice``), at most
  ``num_local_ranks_per_step`` ranks of a host at a time. The small tensors built for real
  (norms) are read from the folder too. Only local folders are read (no download here).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxd_trainer.hf.parallelizer import LAZY_FOLDER

__all__ = ["lazy_load_for_parallelism"]

logger = logging.getLogger(__name__)


def _on_meta(init: Any) -> Any:
    @functools.wraps(init)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        kwargs["device"] = torch.device("meta")
        init(self, *args, **kwargs)

    return wrapped


def _dtype(kwargs: dict[str, Any], config: Any) -> torch.dtype | None:
    """The dtype ``from_pretrained`` would give: ``dtype``/``torch_dtype``, ``"auto"`` or
    None reading the config's."""
    value = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if value is None or value == "auto":
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value)
    return value


def _lazy_from_pretrained(build: Any) -> Any:
    """A ``from_pretrained`` that builds the model from the folder's config (linears and
    embeddings on meta, by the patched constructors) and attaches the folder."""

    def from_pretrained(
        cls: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
    ) -> Any:
        folder = Path(pretrained_model_name_or_path)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"lazy_load_for_parallelism reads local folders; {folder} is not one "
                f"(download the model first, e.g. with huggingface_hub.snapshot_download)"
            )
        if args:
            raise TypeError("lazy from_pretrained takes the folder and keyword arguments only")
        from transformers import AutoConfig

        config = kwargs.get("config") or AutoConfig.from_pretrained(folder)
        model = build(cls, config)
        dtype = _dtype(kwargs, config)
        if dtype is not None:
            model.to(dtype)
        model.config._name_or_path = str(folder)
        model.eval()
        setattr(model, LAZY_FOLDER, str(folder))
        logger.info("built %s lazily from %s (weights read when parallelised)", cls, folder)
        return model

    return from_pretrained


@contextlib.contextmanager
def lazy_load_for_parallelism(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    *,
    expert_parallel_size: int = 1,
) -> Iterator[None]:
    """Make model loading lazy for model parallelism (see the module docstring); nothing
    changes when every size is 1. ``expert_parallel_size`` (nxd's keyword): Mixtral and
    Qwen-MoE folders store their experts per expert, each EP rank reads its experts only."""
    if tensor_parallel_size == 1 and pipeline_parallel_size == 1 and expert_parallel_size == 1:
        yield
        return
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    saved = {
        (nn.Linear, "__init__"): nn.Linear.__init__,
        (nn.Embedding, "__init__"): nn.Embedding.__init__,
        (PreTrainedModel, "from_pretrained"): PreTrainedModel.__dict__["from_pretrained"],
        (_BaseAutoModelClass, "from_pretrained"): _BaseAutoModelClass.__dict__["from_pretrained"],
    }
    nn.Linear.__init__ = _on_meta(nn.Linear.__init__)  # type: ignore[method-assign]
    nn.Embedding.__init__ = _on_meta(nn.Embedding.__init__)  # type: ignore[method-assign]
    PreTrainedModel.from_pretrained = classmethod(  # type: ignore[method-assign,assignment]
        _lazy_from_pretrained(lambda cls, config: cls(config))
    )
    _BaseAutoModelClass.from_pretrained = classmethod(  # type: ignore[method-assign,assignment]
        _lazy_from_pretrained(lambda cls, config: cls.from_config(config))
    )
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
