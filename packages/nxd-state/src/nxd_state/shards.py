"""Shards: where a rank's local tensors sit in the global ones, and the checkpoint protocol.

A box is ``(offsets, shape)``: the elements ``x[o_0 : o_0 + s_0, …, o_{n-1} : o_{n-1} + s_{n-1}]``.
Every piece of a checkpointed tensor is a box of the global tensor (what one process holding
the whole model would have); a rank that loads asks for boxes and receives, for each, the
intersections with the saved boxes:

    A ∩ B = (max(a_i, b_i), min(a_i + s_i, b_i + t_i) - max(a_i, b_i))  per dimension.

A contiguous range ``[start, end)`` of the row-major flattening of a tensor (what a ZeRO-1
shard holds of a parameter) is not a box, but it is a union of at most ``2n - 1`` boxes,
each of them contiguous in memory (:func:`flat_range_boxes`).

A :class:`ShardSpec` says, for one local tensor, which box of it (a :class:`Block`) equals
which box of its global tensor. An object holding checkpoint state describes it through
:class:`CheckpointState`: ``checkpoint_tensors(ctx)`` names its tensors, each with its
:class:`ShardSpec` for this rank (:class:`RankContext`); a checkpoint writes what the specs
say, and a load copies the stored boxes back into the same local tensors. An optimizer whose
state lies in flat ZeRO-1 buffers describes them through :class:`FlatShardedState`; an
optimizer wrapper stepping fp32 master copies of its params through :class:`MasterWeightsState`.
An object whose state is a small JSON value (an LR scheduler) is a :class:`JsonCheckpointState`
(:func:`json_checkpoint_state`: torch's ``state_dict()`` / ``load_state_dict()`` pair, as an
``LRScheduler`` has, through one adapter). The checkpoint code (nxd-ckpt) depends on these types
only, never on the classes implementing them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from nxd_state.parallel_state import get_parallel_state, model_parallel_is_initialized

__all__ = [
    "Block",
    "Box",
    "CheckpointMetadata",
    "CheckpointState",
    "CheckpointTensor",
    "CheckpointTensors",
    "FlatBucket",
    "FlatCheckpointLayout",
    "FlatShardGroup",
    "FlatShardedState",
    "JsonCheckpointState",
    "MasterWeightsLayout",
    "MasterWeightsState",
    "RankContext",
    "ShardSpec",
    "current_rank_context",
    "flat_range_boxes",
    "json_checkpoint_state",
    "linear_index",
    "part_spec",
    "rank_local_spec",
    "shape_mismatch",
    "spec_for_stored_shape",
]


@dataclass(frozen=True)
class Box:
    """``offsets`` and ``shape`` of a rectangular region (same length; 0-d: both empty)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")

    @classmethod
    def whole(cls, shape: tuple[int, ...] | list[int]) -> Box:
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when empty."""
        if other.ndim != self.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        offsets, shape = [], []
        for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape):
            lo, hi = max(a, b), min(a + s, b + t)
            if hi <= lo:
                return None
            offsets.append(lo)
            shape.append(hi - lo)
        return Box(tuple(offsets), tuple(shape))

    def relative_to(self, origin: Box) -> Box:
        """This box in the coordinates of ``origin`` (which must contain it)."""
        return Box(tuple(a - o for a, o in zip(self.offsets, origin.offsets)), self.shape)

    def shifted(self, delta: tuple[int, ...]) -> Box:
        return Box(tuple(a + d for a, d in zip(self.offsets, delta)), self.shape)

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + t <= a + s
            for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape)
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + s) for a, s in zip(self.offsets, self.shape))


def linear_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """Row-major position of the element at ``offsets`` in a tensor of ``shape``."""
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements ``[start, end)`` of the row-major flattening of ``shape``, as boxes in flat
    order: a partial leading row, whole rows, a partial trailing row (recursively), so each
    box is contiguous in memory and together they cover the range exactly once."""
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {total} elements")
    if start == end:
        return []
    if not shape:
        return [Box((), ())]
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    zeros = (0,) * len(inner_shape)
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(end, inner)
    if row0 == row1:  # inside one row
        return [_prepend(row0, box) for box in flat_range_boxes(inner_shape, col0, col1)]
    out = []
    if col0:
        out += [_prepend(row0, box) for box in flat_range_boxes(inner_shape, col0, inner)]
        row0 += 1
    if row1 > row0:
        out.append(Box((row0, *zeros), (row1 - row0, *inner_shape)))
    if col1:
        out += [_prepend(row1, box) for box in flat_range_boxes(inner_shape, 0, col1)]
    return out


def _prepend(row: int, box: Box) -> Box:
    return Box((row, *box.offsets), (1, *box.shape))


@dataclass(frozen=True)
class Block:
    """``local`` box of the local tensor == the same-shaped box at ``global_offsets``."""

    local: Box
    global_offsets: tuple[int, ...]
    primary: bool = True
    """False for a GQA replica: another TP rank's primary block holds the same elements."""

    @property
    def global_box(self) -> Box:
        return Box(self.global_offsets, self.local.shape)


@dataclass
class ShardSpec:
    """The blocks of one local tensor and the global tensor's shape."""

    global_shape: tuple[int, ...]
    blocks: list[Block]
    tp_replicated: bool
    """Every TP rank holds the whole tensor (so any of them may write it)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Recorded in the index: partition_dim, partition_stride, tp_size, GQA layout."""
    rank_local: bool = False
    """Sharding unknown (a plain state dict): saved per (TP, PP) rank, loads only there."""
    padded: ShardSpec | None = None
    """For a padded parameter (whose global tensor is the unpadded one): the spec of the
    padded tensor, which checkpoints written before padding was recorded hold."""
    expert_parallel: bool = False
    """Dim 0 holds experts split over EP: replicated over the expert-DP group only."""


def spec_for_stored_shape(spec: ShardSpec, shape: tuple[int, ...]) -> ShardSpec | None:
    """``spec`` if a stored tensor of global ``shape`` fits it; for a padded parameter, its
    padded spec if the stored tensor is the padded one (older checkpoints); else None."""
    if tuple(spec.global_shape) == tuple(shape):
        return spec
    if spec.padded is not None and tuple(spec.padded.global_shape) == tuple(shape):
        return spec.padded
    return None


def shape_mismatch(name: str, spec: ShardSpec, stored: tuple[int, ...]) -> str:
    """Why a stored tensor of global shape ``stored`` does not fit ``spec``: for an expert
    tensor whose stored experts the EP degree does not divide, that, naming both."""
    ep = int(spec.info.get("expert_model_parallel_size", 1))
    if spec.expert_parallel and stored and stored[0] % ep:
        return (
            f"{name}: the checkpoint holds {stored[0]} experts (shape {tuple(stored)}), which "
            f"expert_model_parallel_size={ep} does not divide (the model holds "
            f"{spec.global_shape[0]})"
        )
    return f"{name}: checkpoint {tuple(stored)}, model {tuple(spec.global_shape)}"


def part_spec(spec: ShardSpec, start: int, rows: int, what: str) -> ShardSpec:
    """Global rows ``[start, start + rows)`` of ``spec``'s tensor as a tensor of its own
    (a stored part): every block cut to those rows along dim 0, its local box still a box of
    the same local tensor, its global offset shifted by ``-start``:

        block (local rows [l, l + n) = global rows [g, g + n))  ∩  [start, start + rows)
        = local rows [l + a - g, l + b - g) = part rows [a - start, b - start),
        a = max(g, start), b = min(g + n, start + rows).
    """
    if spec.rank_local or spec.padded is not None or not spec.global_shape:
        kind = "rank-local" if spec.rank_local else "padded" if spec.padded else "0-d"
        raise ValueError(f"{what}: a {kind} tensor cannot be stored in parts")
    if start < 0 or rows <= 0 or start + rows > spec.global_shape[0]:
        raise ValueError(
            f"{what}: part rows [{start}, {start + rows}) are outside the global tensor's "
            f"{spec.global_shape[0]} rows"
        )
    blocks = []
    for block in spec.blocks:
        g, n = block.global_offsets[0], block.local.shape[0]
        lo, hi = max(g, start), min(g + n, start + rows)
        if lo >= hi:
            continue
        local_offsets, local_shape = list(block.local.offsets), list(block.local.shape)
        local_offsets[0] += lo - g
        local_shape[0] = hi - lo
        global_offsets = (lo - start, *block.global_offsets[1:])
        local = Box(tuple(local_offsets), tuple(local_shape))
        blocks.append(Block(local, global_offsets, block.primary))
    shape = (rows, *spec.global_shape[1:])
    return ShardSpec(
        shape, blocks, spec.tp_replicated, dict(spec.info), expert_parallel=spec.expert_parallel
    )


def rank_local_spec(tensor: torch.Tensor) -> ShardSpec:
    """A tensor whose sharding is unknown: it is its own global tensor, per (TP, PP) rank."""
    shape = tuple(tensor.shape)
    block = Block(Box.whole(shape), (0,) * len(shape))
    return ShardSpec(shape, [block], tp_replicated=False, rank_local=True)


@dataclass(frozen=True)
class RankContext:
    """This process's ranks and the degrees of the layout it runs in.

    With expert parallelism (EP) the EP group is carved out of DP x CP: a non-expert tensor is
    replicated over the n = DP x CP ranks of its (TP, PP) coordinate (``dp_rank`` of
    ``dp_size``), an expert tensor only over the n / EP ranks of its expert-DP group."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    local_rank: int
    distributed: bool
    ep_rank: int = 0
    """Position in the EP group: this rank holds experts [ep_rank E/ep, (ep_rank+1) E/ep)."""
    ep_size: int = 1
    edp_rank: int | None = None
    """Position among the replicas of this rank's experts (None: ``dp_rank``, EP = 1)."""
    edp_size: int | None = None
    """Replicas of this rank's experts, DP x CP / EP (None: ``dp_size``, EP = 1)."""

    @property
    def expert_dp_rank(self) -> int:
        return self.dp_rank if self.edp_rank is None else self.edp_rank

    @property
    def expert_dp_size(self) -> int:
        return self.dp_size if self.edp_size is None else self.edp_size

    def refuse_expert_parallel(self, what: str, reason: str) -> None:
        """Raise for ``what`` at EP > 1 (a path that would drop or mix up experts)."""
        if self.ep_size > 1:
            raise NotImplementedError(
                f"{what} at expert_model_parallel_size={self.ep_size}: {reason}"
            )

    def parallel_dict(self, zero1: bool) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "tensor_parallel_size": self.tp_size,
            "pipeline_parallel_size": self.pp_size,
            "data_parallel_size": self.dp_size,
            "expert_model_parallel_size": self.ep_size,
            "zero1": zero1,
        }

    @property
    def coordinates(self) -> str:
        return f"dp_rank_{self.dp_rank:02d}_tp_rank_{self.tp_rank:02d}_pp_rank_{self.pp_rank:02d}"


def current_rank_context() -> RankContext:
    """This process's :class:`RankContext`: from the current parallel state; without one (or
    without torch.distributed) every rank is a data-parallel replica (a world of one)."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if distributed and model_parallel_is_initialized():
        state = get_parallel_state()
        # The replica axis is DP x CP: weights are replicated over both alike and ZeRO-1
        # shards its state over both (so the DP x CP rank names a replica's files). Expert
        # weights are replicated over the expert-DP group only (EP ranks hold other experts).
        return RankContext(
            rank=rank,
            world_size=world,
            tp_rank=state.tensor_parallel_rank,
            tp_size=state.tensor_parallel_size,
            pp_rank=state.pipeline_parallel_rank,
            pp_size=state.pipeline_parallel_size,
            dp_rank=state.data_context_parallel_ranks.index(rank),
            dp_size=state.data_context_parallel_size,
            local_rank=local_rank,
            distributed=True,
            ep_rank=state.expert_model_parallel_rank,
            ep_size=state.expert_model_parallel_size,
            edp_rank=state.expert_data_parallel_rank,
            edp_size=state.expert_data_parallel_size,
        )
    return RankContext(rank, world, 0, 1, 0, 1, rank, world, local_rank, distributed)


@dataclass
class CheckpointTensor:
    """One tensor of an object's checkpoint state on this rank.

    ``tensor`` is the live local tensor: a save reads it, a load copies the stored boxes into
    it in place (``spec`` says which local box is which global box)."""

    name: str
    """Its name in the checkpoint (a model's: the state-dict name of the unwrapped model)."""
    tensor: torch.Tensor
    spec: ShardSpec
    owner: Any = None
    """The module holding it, whose declarations on its tensors apply (nxd-ckpt's stored
    parts, ``nxd_checkpoint_parts``); None: none apply."""


@dataclass
class CheckpointTensors:
    """What :meth:`CheckpointState.checkpoint_tensors` returns: the tensors, each once, and
    the other names of tied ones (``aliases[other name] = stored name``)."""

    tensors: list[CheckpointTensor]
    aliases: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class CheckpointState(Protocol):
    """An object that describes its own checkpoint state (a pipeline model, a LoRA model)."""

    def checkpoint_tensors(self, ctx: RankContext, *, for_load: bool = False) -> CheckpointTensors:
        """This rank's tensors with their specs. ``for_load``: the tensors a load fills
        (which may differ from what a save writes, e.g. LoRA's merged weights)."""
        ...


@runtime_checkable
class CheckpointMetadata(Protocol):
    """An object with checkpoint metadata of its own (LoRA: its save mode and PEFT config)."""

    def checkpoint_metadata(self) -> dict[str, Any]:
        """JSON-safe entries a checkpoint index keeps beside the tensors, by key."""
        ...


@dataclass(frozen=True)
class FlatBucket:
    """One flat buffer of a ZeRO-1 optimizer, seen from this rank.

    The bucket's params p_1 … p_k lie end to end in a flat vector zero-padded to n·S elements
    (S = ceil(Σ numel / n), n = ``num_shards``); rank r holds elements [rS, (r+1)S) as
    ``master``, which the inner optimizer steps and keys its state by."""

    group_index: int
    """The param group (of the optimizer holding the bucket) its params belong to."""
    params: list[torch.Tensor]
    """The model params flattened into it, in flat order."""
    master: torch.Tensor
    """This rank's shard (1-d, S elements)."""
    num_shards: int
    rank: int

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self.params]


@dataclass(frozen=True, eq=False)
class FlatShardGroup:
    """One ZeRO-1 optimizer's buckets (a whole ZeRO-1 optimizer, or one half of an EP-aware
    one: the dense params over DP x CP, the expert params over expert-DP)."""

    optimizer: Any
    """The ZeRO-1 optimizer: its ``param_groups`` (hyper-parameters) and
    ``refresh_masters_from_params()`` (rebuilds the masters when a checkpoint has none)."""
    inner: torch.optim.Optimizer
    """The optimizer stepping the master shards, keying its state by them."""
    buckets: list[FlatBucket]


@dataclass(frozen=True, eq=False)
class FlatCheckpointLayout:
    """A ZeRO-1 optimizer's state as :meth:`FlatShardedState.flat_checkpoint_layout` says."""

    optimizer: Any
    """The optimizer holding the caller's param groups (over the model's parameters)."""
    groups: list[FlatShardGroup]
    optimizer_class: str
    """The name of the inner optimizer's class (recorded in a checkpoint)."""
    masters_in_checkpoint: bool
    """The fp32 master shards are saved too (``use_master_weights_in_ckpt``)."""


@runtime_checkable
class FlatShardedState(Protocol):
    """An optimizer that may hold its state in flat ZeRO-1 buffers (nxd-optim's ZeRO-1
    optimizers, and ``NxDOptimizer`` wrapping one)."""

    def flat_checkpoint_layout(self, ctx: RankContext) -> FlatCheckpointLayout | None:
        """This rank's buckets under the layout ``ctx`` (None: the state is not flat-sharded);
        raises if they cannot be described exactly (not sharded yet, built under another
        layout)."""
        ...


@dataclass(frozen=True, eq=False)
class MasterWeightsLayout:
    """An optimizer wrapper's state as :meth:`MasterWeightsState.master_checkpoint_layout`
    says: an inner torch optimizer steps θ32, an fp32 master copy, in the place of each
    low-precision param θ (then θ <- cast(θ32)), and the other params themselves."""

    inner: torch.optim.Optimizer
    """The optimizer stepping the masters (and the params without one), keying its state by
    them."""
    masters: dict[torch.Tensor, torch.Tensor]
    """``{model param: its fp32 master}``, each master a same-shaped floating-point tensor in
    ``inner``'s param groups (empty: no masters)."""
    masters_in_checkpoint: bool
    """The masters are saved too (``use_master_weights_in_ckpt``)."""


@runtime_checkable
class MasterWeightsState(Protocol):
    """An optimizer wrapper whose inner optimizer may step fp32 masters of its params in their
    place (nxd-optim's ``NxDOptimizer`` without ZeRO-1). Its own ``state_dict()`` /
    ``load_state_dict()`` and ``param_groups`` are the ones a checkpoint uses."""

    def master_checkpoint_layout(self) -> MasterWeightsLayout:
        """The inner optimizer and the masters, for checkpoints."""
        ...


@runtime_checkable
class JsonCheckpointState(Protocol):
    """An object whose checkpoint state is one JSON-safe value (dicts, lists, numbers,
    strings, None; tensors are stored beside it): an LR scheduler. A checkpoint records the
    object's class name with it and loads only into an object of the same class name."""

    def checkpoint_json(self) -> Any:
        """The state to save (not copied: it is encoded at once)."""
        ...

    def load_checkpoint_json(self, state: Any) -> None:
        """Restore the state :meth:`checkpoint_json` returned (after a save and a load)."""
        ...


class _StateDictJson:
    """torch's ``state_dict()`` / ``load_state_dict()`` pair (``LRScheduler``'s, or any object
    following that convention) as a :class:`JsonCheckpointState`."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def checkpoint_json(self) -> Any:
        return self.owner.state_dict()

    def load_checkpoint_json(self, state: Any) -> None:
        self.owner.load_state_dict(state)


def json_checkpoint_state(obj: Any) -> JsonCheckpointState:
    """``obj`` as a :class:`JsonCheckpointState`: itself when it implements the protocol,
    else its ``state_dict()`` / ``load_state_dict()`` pair (torch's ``LRScheduler``); raises
    TypeError for an object with neither."""
    if isinstance(obj, JsonCheckpointState):
        return obj
    if callable(getattr(obj, "state_dict", None)):
        return _StateDictJson(obj)
    raise TypeError(
        f"{type(obj).__name__} has no checkpoint state: it implements neither "
        f"checkpoint_json() / load_checkpoint_json() (nxd_state.shards.JsonCheckpointState) "
        f"nor state_dict() / load_state_dict()"
    )
