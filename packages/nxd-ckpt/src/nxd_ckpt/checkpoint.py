"""NxD's ``save_checkpoint`` / ``load_checkpoint`` on the nxd-ckpt format.

``save_checkpoint(path, tag, model=…, optimizer=…, scheduler=…, user_content=…)`` writes the
tag folder described in :mod:`nxd_ckpt.format`; every rank must call it. ``load_checkpoint``
reads it back into a model and optimizer at any TP/PP/DP degrees and ZeRO-1 setting and
returns the user content. The steps of a save are :mod:`nxd_ckpt.save._save`'s, those of a
load :mod:`nxd_ckpt.load._load`'s. NxD's checkpoint folders (pickled ``.pt`` files) are read
too, with ``torch.load(weights_only=True)`` (:mod:`nxd_ckpt.nxd_format`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from nxd_ckpt.format import INDEX_NAME, _tags
from nxd_ckpt.format._contain import check_tag
from nxd_ckpt.layout._context import current_context
from nxd_ckpt.load._load import load_native, open_tag
from nxd_ckpt.save import _save, _saver, _step_gate

__all__ = ["finalize_checkpoint", "has_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)


def save_checkpoint(
    path: str | os.PathLike[str],
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
    *,
    async_copy: str = "before_return",
) -> None:
    """Save a checkpoint tag (collective: every rank calls it with the same arguments).

    ``model``: an ``nn.Module`` (``NxDPPModel`` included) or a state dict; ``optimizer``: a
    ``torch.optim`` optimizer, ``NxDOptimizer`` or ``NeuronZero1Optimizer`` (state saved by
    parameter name, which needs ``model``); ``scheduler``: torch's ``LRScheduler``, anything
    with ``state_dict``, or a ``nxd_state.shards.JsonCheckpointState``;
    ``user_content``: dicts/lists/numbers/strings/tensors (no pickle). ``num_workers``: at most
    that many ranks per host write at once (1-32). ``use_xser`` is accepted for NxD
    compatibility: this format always writes tensor by tensor. ``num_kept_ckpts``: keep the
    newest N complete tags. ``async_save``: copy the state to host memory now and write it in
    a background thread; the next save, :func:`finalize_checkpoint`, ``load_checkpoint`` and
    interpreter exit wait for it, and raise its error if it failed. ``zero1_optimizer`` is
    accepted for NxD compatibility (ZeRO-1 is detected from the optimizer).

    ``async_copy`` (nxd's, with ``async_save``): when the copy to host memory is complete.
    ``"before_return"`` (default): before this call returns, so any later change is safe.
    ``"before_step"``: parameters and optimizer state (on CPU) are copied by the background
    thread and the next ``optimizer.step()`` of any ``torch.optim`` optimizer waits for that
    copy; buffers, RNG states and user content are copied now. A parameter or state tensor
    changed in place outside an optimizer step before the copy is detected (version
    counters) and fails the save with its name; a change through ``.data`` is not seen.
    """
    del use_xser, zero1_optimizer  # see the docstring
    _save.save(
        path,
        tag,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        user_content=user_content,
        num_workers=num_workers,
        num_kept_ckpts=num_kept_ckpts,
        async_save=async_save,
        async_copy=async_copy,
    )


def finalize_checkpoint(*, release_host_memory: bool = True) -> None:
    """Wait for a pending async save and raise its error (collective). The host buffer async
    saves copy into is kept between saves (so the next copy does not page-fault), and freed
    here unless ``release_host_memory=False``."""
    _saver.wait_pending()
    if release_host_memory:
        _save.STAGING.release()


def async_copy_waited_s() -> float:
    """Seconds this process's optimizer steps have waited, in total, for the host copies of
    ``async_copy="before_step"`` saves (take the difference around a step to time one wait)."""
    return _step_gate.waited_s()


def has_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds at least one complete tag."""
    root = Path(path)
    return root.is_dir() and _tags.newest_complete_tag(root) is not None


def remove_checkpoint(path: str | os.PathLike[str], tag: str) -> bool:
    """Delete tag ``tag`` of checkpoint folder ``path`` if nxd-ckpt wrote it (``done`` first,
    so an interrupted deletion never leaves a tag that looks complete). Not collective: call
    it on one rank. Returns False when there is nothing at ``path/tag``. ``tag`` must be a
    plain name inside ``path``; a link (ContainmentError), a file (NotADirectoryError) or a
    folder without nxd-ckpt's marker or index (ValueError) is refused and left as it is."""
    folder = Path(path) / check_tag(tag)
    if not os.path.lexists(folder):
        return False
    _tags.remove_tag(folder)
    return True


def load_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    num_workers: int = 8,
    strict: bool = True,
    *,
    allow_pickle: bool = False,
    load_rng: bool = True,
) -> Any:
    """Load tag ``tag`` (None: the newest complete one) into ``model``, ``optimizer`` and
    ``scheduler``; return the user content (None if none was saved). Collective.

    Any TP/PP/DP degrees and ZeRO-1 setting load any checkpoint: each rank reads the boxes
    its local tensors need. ``strict``: missing or unexpected model/optimizer names are an
    error (listed). NxD-layout folders (``model/*.pt`` …) are read with
    ``torch.load(weights_only=True)``; their pickled user content and scheduler only with
    ``allow_pickle=True`` (which executes code from the files: trusted checkpoints only).
    ``load_rng``: restore the RNG states when the layout is the one saved.
    """
    _save.check_num_workers(num_workers)
    _saver.wait_pending()
    ctx = current_context()
    tag_dir, _ = _tags.resolve_tag_dir(path, tag)
    opened = open_tag(tag_dir)
    if opened is None:
        from nxd_ckpt.nxd_format import is_nxd_checkpoint, load_nxd_checkpoint

        if is_nxd_checkpoint(tag_dir):
            return load_nxd_checkpoint(
                tag_dir,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                strict=strict,
                allow_pickle=allow_pickle,
            )
        raise FileNotFoundError(
            f"{tag_dir} has no {INDEX_NAME} and is not in NxD's layout: not a checkpoint"
        )
    if optimizer is not None and model is None:
        logger.info("loading optimizer state without model=: parameters are matched by position")
    with opened as reader:
        return load_native(reader, ctx, model, optimizer, scheduler, num_workers, strict, load_rng)
