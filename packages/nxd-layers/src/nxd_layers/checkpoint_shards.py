"""The checkpoint shard of a parallel layer's tensor, from its sharding attributes.

These attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, the GQA
projection's layout, ``tensor_parallel_padding``, ``expert_model_parallel``) are nxd-layers'
contract, so the :class:`~nxd_state.shards.ShardSpec` they imply is worked out here
(:func:`tensor_shard_spec`), and :func:`module_checkpoint_tensors` walks modules into named
tensors with their specs (the checkpoint protocol's tensors, :mod:`nxd_state.shards`).

A :class:`ShardSpec` says, for one tensor on one rank, which box of the local tensor equals
which box of the global tensor. With TP size t, TP rank r, partition dim d and stride s, the
local tensor holds chunks ``r, r + t, …, r + (s-1)t`` of the ``t·s`` equal chunks of the global
tensor along d (chunk size c = local size / s):

    local[j·c : (j+1)·c]  =  global[(j·t + r)·c : (j·t + r + 1)·c]     along d, j < s.

GQA K/V projections replicate each KV head ``kv_size_multiplier`` times before splitting; the
global tensor is the *unreplicated* one (what one process holds), and only the first copy of
each head is "primary" (written). A fused ``weight_qkv`` is the concatenation [Q; K; V] of the
global projections. Replicated (non-TP) tensors are one whole block held by every TP rank.

A parameter padded by ``nxd_layers.pad_model`` (marked ``tensor_parallel_padding``) is stored
*unpadded*: its global tensor is the one before padding, each block is cut to the runs of
real data the mark names and moved to unpadded coordinates, and the zeros belong to no block
(written nowhere, zero-filled on load). So it loads at any TP degree, padded or not, and
exports without the padding.

An expert parameter (``expert_model_parallel``, NxD's ``nxd_layers.moe`` marks) holds the
experts of its EP rank along dim 0, inside which the TP split above applies. With EP size e,
EP rank q and n local experts, every TP block moves to its experts' rows of the global tensor
(all E = n·e experts):

    local[i] (within a block)  =  global[q·n + i]     along dim 0, i < n,

so its global shape is (E, …) and loads at any EP degree dividing E. It is replicated over
the expert-DP group only (``ShardSpec.expert_parallel``), which picks its writers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeGuard

import torch
from torch import nn

from nxd_state.shards import (
    Block,
    Box,
    CheckpointTensor,
    CheckpointTensors,
    RankContext,
    ShardSpec,
)

__all__ = [
    "GQALayout",
    "expert_parallel_degree",
    "gqa_spec",
    "is_gqa",
    "module_checkpoint_tensors",
    "tensor_shard_spec",
]


def _rows_blocks(shape: tuple[int, ...], runs: list[tuple[int, int, int, bool]]) -> list[Block]:
    """Blocks along dim 0 from runs ``(local_row, global_row, rows, primary)``."""
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)
    return [
        Block(Box((lo, *zeros), (n, *rest)), (go, *zeros), primary)
        for lo, go, n, primary in runs
        if n > 0
    ]


def _merge_runs(rows: list[tuple[int, bool]]) -> list[tuple[int, int, int, bool]]:
    """Runs of consecutive local rows whose global rows are consecutive and equally primary;
    ``rows[i] = (global_row, primary)`` for local row i."""
    runs: list[tuple[int, int, int, bool]] = []
    for local, (glob, primary) in enumerate(rows):
        if runs:
            lo, go, n, p = runs[-1]
            if p == primary and go + n == glob and lo + n == local:
                runs[-1] = (lo, go, n + 1, p)
                continue
        runs.append((local, glob, 1, primary))
    return runs


def _partitioned(
    local_shape: tuple[int, ...], dim: int, stride: int, rank: int, size: int
) -> ShardSpec:
    dim = dim % len(local_shape)
    length = local_shape[dim]
    if stride < 1 or length % stride:
        raise ValueError(
            f"partition_stride({stride}) does not divide the local size {length} of dim {dim}"
        )
    chunk = length // stride
    global_shape = list(local_shape)
    global_shape[dim] = length * size
    blocks = []
    for j in range(stride):
        local_off = [0] * len(local_shape)
        global_off = [0] * len(local_shape)
        local_off[dim] = j * chunk
        global_off[dim] = (j * size + rank) * chunk
        block_shape = list(local_shape)
        block_shape[dim] = chunk
        blocks.append(Block(Box(tuple(local_off), tuple(block_shape)), tuple(global_off)))
    info = {"partition_dim": dim, "partition_stride": stride, "tp_size": size}
    return ShardSpec(tuple(global_shape), blocks, tp_replicated=False, info=info)


class GQALayout(Protocol):
    """What the checkpoint reads of a GQA QKV projection (nxd_layers' layer or one with NxD's
    attributes): ``output_sizes = [q_size, kv_size]``, the KV replication and the fusion."""

    @property
    def output_sizes(self) -> Sequence[int]: ...

    @property
    def kv_size_multiplier(self) -> int: ...

    @property
    def fuse_qkv(self) -> bool: ...


def _replica_rows(module: GQALayout) -> list[int]:
    """For each row of the replicated K (or V) projection, its row in the unreplicated one.

    nxd_layers' GQA layer says so itself (``kv_replica_rows()``: head by head); a layer
    without that method is taken to replicate as NxD's does (the whole projection repeated
    ``kv_size_multiplier`` times).
    """
    rows = getattr(module, "kv_replica_rows", None)
    if rows is not None:
        return [int(row) for row in rows()]
    kv_size = int(module.output_sizes[1])
    return [row for _ in range(int(module.kv_size_multiplier)) for row in range(kv_size)]


def gqa_spec(
    q_size: int,
    kv_size: int,
    multiplier: int,
    replica_rows: list[int],
    local_name: str,
    local_shape: tuple[int, ...],
    rank: int,
    tp: int,
) -> ShardSpec:
    """The GQA QKV projection's weights and biases (see the module docstring): the layout
    of rank ``rank`` of ``tp`` when K/V are replicated ``multiplier`` times, row i of the
    replicated K (or V) copying row ``replica_rows[i]``; ``local_name`` ends in ``_q``,
    ``_k``, ``_v`` or ``_qkv``."""
    q_local = q_size // tp
    kv_local = kv_size * multiplier // tp
    seen: set[int] = set()
    primary_of = []  # replicated row -> first occurrence?
    for row in replica_rows:
        primary_of.append(row not in seen)
        seen.add(row)

    def kv_rows(offset: int) -> list[tuple[int, bool]]:
        mine = range(rank * kv_local, (rank + 1) * kv_local)
        return [(offset + replica_rows[j], primary_of[j]) for j in mine]

    q_rows = [(rank * q_local + i, True) for i in range(q_local)]
    part = local_name.rpartition("_")[2]
    info: dict[str, Any] = {
        "partition_dim": 0,
        "partition_stride": 1,
        "tp_size": tp,
        "layout": "gqa_qkv",
        "q_size": q_size,
        "kv_size": kv_size,
        "kv_size_multiplier": multiplier,
        "part": part,
    }
    if part == "qkv":
        rows = q_rows + kv_rows(q_size) + kv_rows(q_size + kv_size)
        global_rows = q_size + 2 * kv_size
    elif part == "q":
        rows, global_rows = q_rows, q_size
    else:
        rows, global_rows = kv_rows(0), kv_size
    if len(rows) != local_shape[0]:
        raise ValueError(
            f"GQA parameter {local_name} has {local_shape[0]} local rows, its layout says "
            f"{len(rows)} (q_size={q_size}, kv_size={kv_size}, multiplier={multiplier}, tp={tp})"
        )
    blocks = _rows_blocks(local_shape, _merge_runs(rows))
    return ShardSpec((global_rows, *local_shape[1:]), blocks, tp_replicated=False, info=info)


def _gqa_spec(
    module: GQALayout, local_name: str, local_shape: tuple[int, ...], rank: int, tp: int
) -> ShardSpec:
    """:func:`gqa_spec` with the layout of ``module`` (a GQA QKV projection)."""
    q_size, kv_size = (int(s) for s in module.output_sizes)
    multiplier = int(module.kv_size_multiplier)
    replica_rows = _replica_rows(module) if multiplier > 1 else list(range(kv_size))
    return gqa_spec(q_size, kv_size, multiplier, replica_rows, local_name, local_shape, rank, tp)


def _unpadded(spec: ShardSpec, padding: Any, what: str) -> ShardSpec:
    """The spec of the unpadded tensor from that of the padded one (see the module
    docstring): blocks cut to ``padding.runs()`` along ``padding.dim`` and shifted there."""
    dim = int(padding.dim)
    if dim >= len(spec.global_shape) or spec.global_shape[dim] != padding.padded_size:
        raise ValueError(
            f"{what}: tensor_parallel_padding says dim {dim} was padded to "
            f"{padding.padded_size}, but the tensor's global shape is {spec.global_shape}"
        )
    blocks = []
    for block in spec.blocks:
        start, length = block.global_offsets[dim], block.local.shape[dim]
        for padded_start, unpadded_start, run in padding.runs():
            lo, hi = max(start, padded_start), min(start + length, padded_start + run)
            if lo >= hi:
                continue
            local_offsets, shape = list(block.local.offsets), list(block.local.shape)
            global_offsets = list(block.global_offsets)
            local_offsets[dim] += lo - start
            shape[dim] = hi - lo
            global_offsets[dim] = unpadded_start + lo - padded_start
            blocks.append(
                Block(Box(tuple(local_offsets), tuple(shape)), tuple(global_offsets), block.primary)
            )
    shape = list(spec.global_shape)
    shape[dim] = int(padding.unpadded_size)
    info = {**spec.info, "padding": padding.to_dict()}
    return ShardSpec(
        tuple(shape),
        blocks,
        spec.tp_replicated,
        info,
        spec.rank_local,
        padded=spec,
        expert_parallel=spec.expert_parallel,
    )


def is_gqa(module: object) -> TypeGuard[GQALayout]:
    """Whether ``module`` is a GQA QKV projection (by the attributes its layout is read from)."""
    return module is not None and all(
        hasattr(module, name) for name in ("kv_size_multiplier", "output_sizes", "fuse_qkv")
    )


def tensor_shard_spec(
    tensor: torch.Tensor,
    *,
    tp_rank: int,
    tp_size: int,
    module: nn.Module | None = None,
    local_name: str = "",
    ep_rank: int = 0,
    ep_size: int = 1,
    what: str = "",
) -> ShardSpec:
    """The spec of a parameter or buffer from its sharding attributes (and, for the GQA QKV
    projection, its owning ``module``; ``local_name`` is its name inside that module). A
    tensor marked ``tensor_parallel_padding`` gets the spec of its unpadded tensor; one
    marked ``expert_model_parallel`` has its experts placed at EP rank ``ep_rank`` of
    ``ep_size`` (see the module docstring). ``what`` names it in errors."""
    what = what or local_name or f"tensor of shape {tuple(tensor.shape)}"
    spec = _padded_spec(tensor, tp_rank, tp_size, module, local_name)
    if getattr(tensor, "expert_model_parallel", False):
        spec = _expert_spec(spec, tensor, ep_rank, ep_size, what)
    padding = getattr(tensor, "tensor_parallel_padding", None)
    if padding is None:
        return spec
    if spec.expert_parallel and int(padding.dim) == 0:
        raise ValueError(f"{what}: an expert parameter padded along dim 0 (its experts)")
    return _unpadded(spec, padding, what)


def expert_parallel_degree(tensor: torch.Tensor) -> int:
    """The EP degree an ``expert_model_parallel`` tensor says it was split over (1 if
    unmarked)."""
    if not getattr(tensor, "expert_model_parallel", False):
        return 1
    return int(getattr(tensor, "expert_model_parallel_size", 1))


def _expert_spec(
    spec: ShardSpec, tensor: torch.Tensor, ep_rank: int, ep_size: int, what: str
) -> ShardSpec:
    """``spec`` (the TP blocks of the local experts) with dim 0 placed at EP rank
    ``ep_rank`` of ``ep_size``: global rows ``[ep_rank·n, (ep_rank+1)·n)``, n local experts."""
    dim = int(getattr(tensor, "expert_partition_dim", 0))
    declared = expert_parallel_degree(tensor)
    if dim != 0:
        raise ValueError(
            f"{what}: expert_partition_dim={dim}; checkpoints shard experts along dim 0 only"
        )
    if declared != ep_size:
        raise ValueError(
            f"{what}: marked expert_model_parallel_size={declared}, but the parallel state's "
            f"expert_model_parallel_size is {ep_size}: its experts' place in the global tensor "
            f"is unknown (build the model after initialize_model_parallel)"
        )
    if not spec.global_shape or spec.rank_local:
        raise ValueError(f"{what}: an expert parameter needs dim 0 (experts), got a 0-d tensor")
    if spec.info.get("partition_dim") == 0:
        raise ValueError(f"{what}: an expert parameter split over TP along dim 0 (its experts)")
    local = int(tensor.shape[0])
    shift = ep_rank * local
    blocks = [
        Block(b.local, (b.global_offsets[0] + shift, *b.global_offsets[1:]), b.primary)
        for b in spec.blocks
    ]
    shape = (local * ep_size, *spec.global_shape[1:])
    info = {**spec.info, "expert_partition_dim": 0, "expert_model_parallel_size": ep_size}
    return ShardSpec(shape, blocks, spec.tp_replicated, info, spec.rank_local, expert_parallel=True)


def _padded_spec(
    tensor: torch.Tensor,
    tp_rank: int,
    tp_size: int,
    module: nn.Module | None,
    local_name: str,
) -> ShardSpec:
    """The spec from the sharding attributes alone (padding not taken into account)."""
    shape = tuple(tensor.shape)
    if not getattr(tensor, "tensor_model_parallel", False):
        return ShardSpec(shape, [Block(Box.whole(shape), (0,) * len(shape))], tp_replicated=True)
    if is_gqa(module) and local_name.startswith(("weight_", "bias_")):
        return _gqa_spec(module, local_name, shape, tp_rank, tp_size)
    dim = int(getattr(tensor, "partition_dim", 0))
    stride = int(getattr(tensor, "partition_stride", 1))
    if not shape:
        raise ValueError("a 0-d tensor cannot be tensor-parallel")
    return _partitioned(shape, dim, stride, tp_rank, tp_size)


def module_checkpoint_tensors(
    modules: Sequence[nn.Module], ctx: RankContext, *, owners: bool = True
) -> CheckpointTensors:
    """Every tensor of the state dicts of ``modules`` (a model, or a pipeline model's local
    stages: their state-dict names are the original model's) with its spec on this rank; a
    tensor tied under several names is listed once, under the first, the others as aliases.
    ``owners``: record each tensor's owning module (:attr:`CheckpointTensor.owner`)."""
    out: list[CheckpointTensor] = []
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for stage in modules:
        by_name = dict(stage.named_modules())
        for name, tensor in stage.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if id(tensor) in first_name:
                if first_name[id(tensor)] != name:
                    aliases[name] = first_name[id(tensor)]
                continue
            first_name[id(tensor)] = name
            prefix, _, local = name.rpartition(".")
            module = by_name.get(prefix)
            spec = tensor_shard_spec(
                tensor,
                tp_rank=ctx.tp_rank,
                tp_size=ctx.tp_size,
                module=module,
                local_name=local,
                ep_rank=ctx.ep_rank,
                ep_size=ctx.ep_size,
                what=name,
            )
            out.append(CheckpointTensor(name, tensor, spec, module if owners else None))
    return CheckpointTensors(out, aliases)
