"""NxD's legacy ``parallel_layers.save`` / ``load``, on safetensors.

Layout, as NxD's (one folder per TP/PP rank, written by DP rank 0)::

    <dir>/tp_rank_XX_pp_rank_YY/checkpoint.safetensors   the tensors of the saved structure
    <dir>/tp_rank_XX_pp_rank_YY/checkpoint.json          the structure (dicts, numbers …)

with ``_dp_rank_DD`` appended to the folder when every DP rank saves (``master_dp_only=False``).
Per-rank files carry no sharding metadata, as in NxD: they load back at the same degrees
(``save_checkpoint`` is the resharding format). ``load`` also reads NxD's own pickled
``checkpoint.pt`` files and xser folders, with ``torch.load(weights_only=True)`` only, and with
``sharded=False`` one unsharded state dict (a safetensors file, a Hugging Face folder or a
``.pt`` file) into a sharded model, each rank reading only its slices. Inside the folder
the user names nothing is a link (a rank folder or file that is one is refused, as in
:mod:`nxd_ckpt.format._contain`), and a damaged file is an error naming it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from nxd_ckpt.format import (
    CheckpointIndex,
    ChunkRecord,
    ContainmentError,
    FormatError,
    TensorRecord,
    _jsonstate,
)
from nxd_ckpt.format._contain import open_regular, real_dir
from nxd_ckpt.format._stfile import dtype_name, plan_file, write_planned, write_text_atomic
from nxd_ckpt.format._stread import SafetensorsFile
from nxd_ckpt.layout._context import RankContext, barrier, current_context
from nxd_ckpt.load._load_model import load_model
from nxd_ckpt.load._reader import CheckpointReader

__all__ = ["load", "save"]

logger = logging.getLogger(__name__)


def _rank_folder(root: Path, ctx: RankContext, master_dp_only: bool) -> Path:
    name = f"tp_rank_{ctx.tp_rank:02d}_pp_rank_{ctx.pp_rank:02d}"
    return root / (name if master_dp_only else f"{name}_dp_rank_{ctx.dp_rank:02d}")


def _write(folder: Path, checkpoint: Any, down_cast_bf16: bool) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _jsonstate.encode(checkpoint, tensors, "checkpoint", "the checkpoint")
    folder.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if down_cast_bf16 and tensor.dtype == torch.float32:
            tensor = tensor.to(torch.bfloat16)
        prepared[key] = tensor.contiguous()
    plan = plan_file([(k, t.dtype, tuple(t.shape)) for k, t in prepared.items()], {"format": "pt"})
    write_planned(folder / "checkpoint.safetensors", plan, [prepared[e.key] for e in plan.entries])
    write_text_atomic(folder / "checkpoint.json", json.dumps(skeleton))


def save(
    checkpoint: Any,
    output_dir: str | os.PathLike[str],
    save_serially: bool = True,
    save_xser: bool = False,
    down_cast_bf16: bool = False,
    master_dp_only: bool = True,
) -> None:
    """NxD's ``parallel_layers.save``: each TP/PP rank's ``checkpoint`` (a state dict or a
    nested dict of them) in its ``tp_rank_XX_pp_rank_YY`` folder; DP rank 0 writes (every DP
    rank with ``master_dp_only=False``). ``save_serially``: one TP/PP rank at a time.
    ``down_cast_bf16``: fp32 tensors are stored as bf16. ``save_xser`` is accepted: the file
    is always written tensor by tensor. Collective."""
    del save_xser
    ctx = current_context()
    if master_dp_only:  # DP rank 0 alone would write only EP rank 0's experts
        ctx.refuse_expert_parallel(
            "parallel_layers.save(master_dp_only=True)",
            "DP rank 0 would write EP rank 0's experts only; pass master_dp_only=False "
            "(every DP rank writes its own folder) or use save_checkpoint, which shards "
            "experts over EP",
        )
    folder = _rank_folder(Path(output_dir), ctx, master_dp_only)
    writes = ctx.dp_rank == 0 or not master_dp_only
    if not save_serially:
        if writes:
            _write(folder, checkpoint, down_cast_bf16)
        barrier()
        return
    for turn in range(ctx.tp_size * ctx.pp_size):
        if writes and turn == ctx.pp_rank * ctx.tp_size + ctx.tp_rank:
            _write(folder, checkpoint, down_cast_bf16)
        barrier()
    logger.info("saved %s", folder)


def _no_link(path: Path) -> None:
    if path.is_symlink():
        raise ContainmentError(
            f"{path} is a symbolic link: nxd-ckpt does not follow links inside a checkpoint folder"
        )


def _read_safetensors_pair(folder: Path) -> Any:
    """``checkpoint.safetensors`` + ``checkpoint.json`` of a rank folder, checked."""
    weights = SafetensorsFile(folder / "checkpoint.safetensors")
    try:
        tensors = {key: weights.tensor(key) for key in weights.entries}
    finally:
        weights.close()
    structure = folder / "checkpoint.json"
    try:
        fd = open_regular(structure)
    except FileNotFoundError:
        raise FormatError(f"{structure} is missing (checkpoint.safetensors is there)") from None
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read()
    try:
        skeleton = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise FormatError(f"{structure} is not valid JSON: {error}") from None
    _jsonstate.check_encoded(skeleton, set(tensors), str(structure))
    return _jsonstate.decode(skeleton, tensors)


def _read_rank_file(root: Path, ctx: RankContext, master_dp_only: bool) -> Any:
    from nxd_ckpt.nxd_format import torch_load_safe

    folder = _rank_folder(root, ctx, master_dp_only)
    if os.path.lexists(folder) and not folder.is_file():
        real_dir(folder, "rank folder")
    if folder.is_dir() and os.path.lexists(folder / "checkpoint.safetensors"):
        return _read_safetensors_pair(folder)
    for candidate in (folder / "checkpoint.pt", folder):  # NxD's pickled file, or xser ref file
        _no_link(candidate)
        if candidate.is_file():
            return torch_load_safe(candidate)
    raise FileNotFoundError(
        f"no checkpoint for TP rank {ctx.tp_rank}, PP rank {ctx.pp_rank} in {root}: expected "
        f"{folder}/checkpoint.safetensors (or NxD's {folder}/checkpoint.pt)"
    )


@torch.no_grad()
def _load_local(target: Any, state: dict[str, torch.Tensor], strict: bool) -> None:
    """Copy a rank's own state dict into its local tensors (NxDPPModel stages included)."""
    from nxd_ckpt.layout._context import agree
    from nxd_ckpt.layout._model_tensors import model_tensors

    tensors, aliases = model_tensors(target, current_context())
    known = {local.name for local in tensors} | set(aliases)
    missing = [t.name for t in tensors if t.name not in state]
    unexpected = sorted(set(state) - known)
    mismatched = [
        f"{t.name}: checkpoint {tuple(state[t.name].shape)}, model {tuple(t.tensor.shape)}"
        for t in tensors
        if t.name in state and state[t.name].shape != t.tensor.shape
    ]
    problems = [f"shape mismatch: {mismatched}"] if mismatched else []
    if strict and (missing or unexpected):
        problems.append(f"missing keys: {missing}, unexpected keys: {unexpected}")
    agree(ValueError("; ".join(problems)) if problems else None, "parallel_layers.load")
    for local in tensors:
        if local.name in state:
            local.tensor.copy_(state[local.name])


def _unsharded_index(state: dict[str, torch.Tensor]) -> tuple[CheckpointIndex, dict[str, Any]]:
    from nxd_ckpt.nxd_format import _TorchSource

    index = CheckpointIndex(tag="", save_id="", parallel={})
    index.tensors["model"] = {
        name: TensorRecord(
            list(t.shape),
            dtype_name(t.dtype),
            [ChunkRecord("state", name, [0] * t.dim(), list(t.shape), [], 1)],
        )
        for name, t in state.items()
        if isinstance(t, torch.Tensor)
    }
    return index, {"state": _TorchSource(lambda: state)}


def _load_unsharded(target: Any, path: Path, model_key: str | None, strict: bool) -> Any:
    from nxd_ckpt.hf import load_hf_checkpoint
    from nxd_ckpt.nxd_format import torch_load_safe

    if path.is_dir() or path.suffix == ".safetensors":
        load_hf_checkpoint(target, path, strict=strict)
        return None
    loaded = torch_load_safe(path)
    state = loaded[model_key] if model_key is not None and model_key in loaded else loaded
    index, sources = _unsharded_index(state)
    load_model(
        target,
        CheckpointReader(path.parent, index=index, sources=sources),
        current_context(),
        strict,
    )
    if isinstance(loaded, dict) and model_key in loaded:
        return {k: v for k, v in loaded.items() if k != model_key}
    return None


def load(
    chkpt_path: str | os.PathLike[str],
    model_or_optimizer: Any = None,
    model_key: str | None = "model",
    load_xser: bool = False,
    sharded: bool = True,
    *,
    model: Any = None,
    strict: bool = True,
    master_dp_only: bool = True,
    weights_only: bool = True,
) -> Any:
    """NxD's ``parallel_layers.load``. Returns the checkpoint; when ``model_or_optimizer``
    (or the deprecated ``model``) is given, its ``model_key`` entry is loaded into it and the
    rest is returned. ``sharded=False``: ``chkpt_path`` is one unsharded state dict (a
    safetensors file, a Hugging Face folder or a ``.pt`` file) loaded into the sharded model
    slice by slice. ``load_xser`` and ``weights_only`` are accepted: files are read without
    pickle (``.pt`` files with ``torch.load(weights_only=True)``) whatever they say."""
    del load_xser, weights_only
    target = model if model is not None else model_or_optimizer
    path = Path(chkpt_path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if not sharded:
        if target is None:
            raise ValueError(
                "load(sharded=False) needs model_or_optimizer: the model to shard into"
            )
        return _load_unsharded(target, path, model_key, strict)
    ctx = current_context()
    if master_dp_only:  # one folder per TP/PP rank: EP rank 0's experts for every EP rank
        ctx.refuse_expert_parallel(
            "parallel_layers.load(master_dp_only=True)",
            "every EP rank would read DP rank 0's experts; load per-DP-rank folders "
            "(master_dp_only=False), one unsharded state dict (sharded=False) or a "
            "save_checkpoint folder",
        )
    checkpoint = _read_rank_file(path, ctx, master_dp_only)
    if target is None:
        return checkpoint
    state = checkpoint[model_key] if model_key is not None else checkpoint
    if isinstance(target, torch.optim.Optimizer):
        target.load_state_dict(state)
    else:
        _load_local(target, state, strict)
    if model_key is None:
        return None
    return {k: v for k, v in checkpoint.items() if k != model_key}
