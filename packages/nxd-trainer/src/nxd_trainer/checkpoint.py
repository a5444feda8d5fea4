"""NxD's trainer checkpoints: ``save_checkpoint`` / ``load_checkpoint`` on the wrappers.

A checkpoint of a training job is the state that makes the next step what it would have been:
the model's parameters and buffers, the optimizer's state (ZeRO-1 shards, fp32 masters when
kept), the LR scheduler, every RNG stream (CPU/device generators and the model-parallel
tracker's, so dropout masks continue) and the user's content (e.g. the step count). nxd-ckpt
writes all of it (safetensors + JSON, no pickle, one tag folder, ``done`` last); this module
takes the trainer's objects as they come:

* the model: an :class:`~nxd_trainer.NxDModel` (its local module: the model, an NxDPPModel's
  stages or a LoRA model, whose save mode then applies), or a plain module / NxDPPModel /
  state dict;
* the optimizer: the wrapper of ``initialize_parallel_optimizer`` (ZeRO-1 or not), a
  ``NeuronZero1Optimizer`` or a plain ``torch.optim`` optimizer; its state is saved by
  parameter name when the model is given in the same call (else by position: same layout);
* the scheduler: anything with ``state_dict`` / ``load_state_dict`` of JSON-safe values, or
  implementing :class:`nxd_state.shards.JsonCheckpointState`.

At the same degrees a resumed job continues bitwise on CPU (the tests prove it at TP=2, PP=2,
TP=2 x PP=2 x DP=2 with ZeRO-1, and EP=2 for Hugging Face MoE models); at other degrees
nxd-ckpt reshards on load (experts included: EP and TP).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from nxd_state.shards import JsonCheckpointState
from nxd_trainer.config import NxDConfig
from nxd_trainer.model import NxDModel

__all__ = ["finalize_checkpoint", "has_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)


def _model(model: Any) -> Any:
    """What nxd-ckpt saves for ``model``: an NxDModel's local module, else ``model`` itself."""
    if isinstance(model, NxDModel):
        return model.module  # the model, an NxDPPModel or a LoRAModel
    return model


def _check_types(model: Any, optimizer: Any, scheduler: Any) -> None:
    """Argument types, checked on every rank before nxd-ckpt's first collective."""

    if model is not None and not isinstance(model, (nn.Module, dict)):
        raise TypeError(
            f"model must be an NxDModel, a torch.nn.Module or a state dict, got "
            f"{type(model).__name__}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (the optimizer wrapper of "
            f"initialize_parallel_optimizer included), got {type(optimizer).__name__}"
        )
    if scheduler is not None and not (
        isinstance(scheduler, JsonCheckpointState)
        or (
            callable(getattr(scheduler, "state_dict", None))
            and callable(getattr(scheduler, "load_state_dict", None))
        )
    ):
        raise TypeError(
            f"scheduler must have state_dict() and load_state_dict(), or implement "
            f"nxd_state.shards.JsonCheckpointState, got {type(scheduler).__name__}"
        )


def _check_config(nxd_config: Any, optimizer: Any, zero1_optimizer: bool) -> bool:
    """``zero1_optimizer`` as the config and the optimizer say; a contradiction is an error."""
    zero1 = bool(zero1_optimizer)
    if nxd_config is None:
        return zero1
    config = NxDConfig.from_nxd(nxd_config)
    from nxd_optim import NeuronZero1Optimizer, NxDOptimizer

    if isinstance(optimizer, NxDOptimizer):
        sharded = isinstance(optimizer.optimizer, NeuronZero1Optimizer)
        if sharded != config.optimizer_config.zero_one_enabled:
            raise ValueError(
                f"nxd_config['optimizer_config']['zero_one_enabled'] is "
                f"{config.optimizer_config.zero_one_enabled} but the optimizer "
                f"{'is' if sharded else 'is not'} ZeRO-1: pass the config it was built with"
            )
    return zero1 or config.optimizer_config.zero_one_enabled


def _note_zero1_dcp(use_zero1_dcp: bool) -> None:
    """``use_zero1_dcp=True`` (NxD: ZeRO-1 optimizer state through torch Distributed
    Checkpoint) changes nothing: nxd's format already stores ZeRO-1 state by parameter name and
    reshards it on load. Said once per process."""
    global _ZERO1_DCP_NOTED
    if not isinstance(use_zero1_dcp, bool):
        raise TypeError(f"use_zero1_dcp must be a bool, got {use_zero1_dcp!r}")
    if use_zero1_dcp and not _ZERO1_DCP_NOTED:
        _ZERO1_DCP_NOTED = True
        logger.info(
            "use_zero1_dcp=True: nxd's checkpoint format is used for the ZeRO-1 optimizer "
            "state (it is resharded on load, as torch DCP would)"
        )


_ZERO1_DCP_NOTED = False


def _kept(num_kept_ckpts: Any) -> Any:
    """NxD's ``num_kept_ckpts``: None or -1 (its scripts' default) keep every tag, N >= 1 the
    newest N; 0 and other negatives say neither and are refused."""
    if isinstance(num_kept_ckpts, int) and not isinstance(num_kept_ckpts, bool):
        if num_kept_ckpts == -1:
            return None
        if num_kept_ckpts < 1:
            raise ValueError(
                f"num_kept_ckpts must be None or -1 (keep every checkpoint) or >= 1 (keep the "
                f"newest N), got {num_kept_ckpts}"
            )
    return num_kept_ckpts  # None, N >= 1, or a bad type that nxd-ckpt names


def save_checkpoint(
    checkpoint_dir_str: str | os.PathLike[str],
    tag: str = "",
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    num_workers: int = 8,
    use_xser: bool = False,
    num_kept_ckpts: int | None = None,
    async_save: bool = False,
    zero1_optimizer: bool = False,
    use_zero1_dcp: bool = False,
    *,
    nxd_config: dict[str, Any] | NxDConfig | None = None,
    async_copy: str = "before_return",
) -> None:
    """NxD's ``save_checkpoint``: write tag ``tag`` under ``checkpoint_dir_str`` (collective:
    every rank calls it with the same arguments). Returns None.

    Saves ``model`` (an :class:`~nxd_trainer.NxDModel` or a plain module; a LoRA model as its
    config's save mode says: adapter, base + adapter, or merged), ``optimizer`` (by parameter
    name: ZeRO-1 shards and kept fp32 masters included), ``scheduler``, ``user_content``
    (dicts, lists, numbers, strings, tensors; no pickle) and every RNG state of every rank.
    ``tag=""`` writes into ``checkpoint_dir_str`` itself. ``num_kept_ckpts`` keeps the newest N
    complete tags (None or -1: all of them); ``async_save`` copies the state to host memory
    and writes it in the background (the next save, :func:`load_checkpoint`,
    :func:`finalize_checkpoint` and interpreter exit wait for it). ``num_workers``: ranks of
    a host writing at once (1-32). ``use_xser`` is accepted (the format always writes tensor
    by tensor). ``nxd_config`` (the reference's sample passes it) is checked against the
    optimizer; ``zero1_optimizer`` is accepted as in NxD (ZeRO-1 is read from the
    optimizer). ``use_zero1_dcp`` is accepted and
    changes nothing (see :func:`load_checkpoint`). ``async_copy`` (nxd's, with ``async_save``):
    ``"before_return"`` copies the whole state to host memory before returning;
    ``"before_step"`` returns at once and the next optimizer step waits for the copy of the
    parameters and optimizer state (``nxd_ckpt.save_checkpoint`` says when that is safe).
    """
    import nxd_ckpt

    _check_types(model, optimizer, scheduler)
    _note_zero1_dcp(use_zero1_dcp)
    zero1 = _check_config(nxd_config, optimizer, zero1_optimizer)
    nxd_ckpt.save_checkpoint(
        checkpoint_dir_str,
        tag,
        model=_model(model),
        optimizer=optimizer,
        scheduler=scheduler,
        user_content=user_content,
        num_workers=num_workers,
        use_xser=use_xser,
        num_kept_ckpts=_kept(num_kept_ckpts),
        async_save=async_save,
        zero1_optimizer=zero1,
        async_copy=async_copy,
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    num_workers: int = 8,
    strict: bool = True,
    use_zero1_dcp: bool = False,
) -> Any:
    """NxD's ``load_checkpoint``: load tag ``tag`` (None: the newest complete one) into
    ``model``, ``optimizer`` and ``scheduler``, restore the RNG states (when the layout is
    the saved one) and return the user content (None if none was saved). Collective.

    ``model`` is an :class:`~nxd_trainer.NxDModel` or a plain module; a checkpoint saved at
    other TP/PP/DP degrees or ZeRO-1 setting is resharded on load. ``strict``: names missing
    from the checkpoint, or in it but in no rank's model, are an error (listed). A folder with
    no complete tag is an error naming it (see :func:`has_checkpoint` to test first).
    ``use_zero1_dcp`` (NxD: ZeRO-1 optimizer state through torch Distributed Checkpoint) is
    accepted and changes nothing: nxd's format stores that state by parameter name and
    reshards it on load in either case (True is logged once).
    """
    import nxd_ckpt

    _check_types(model, optimizer, scheduler)
    _note_zero1_dcp(use_zero1_dcp)
    return nxd_ckpt.load_checkpoint(
        path,
        tag,
        model=_model(model),
        optimizer=optimizer,
        scheduler=scheduler,
        num_workers=num_workers,
        strict=strict,
    )


def has_checkpoint(checkpoint_dir_str: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint_dir_str`` holds a complete checkpoint tag (what
    ``load_checkpoint(checkpoint_dir_str)`` loads)."""
    import nxd_ckpt

    return nxd_ckpt.has_checkpoint(checkpoint_dir_str)


def finalize_checkpoint() -> None:
    """Wait for a pending ``async_save`` and raise its error, if any (collective)."""
    import nxd_ckpt

    nxd_ckpt.finalize_checkpoint()
