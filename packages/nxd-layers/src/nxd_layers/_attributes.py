"""Parameter sharding attributes, group resolution and the divisibility arithmetic.

A parameter of a tensor-parallel layer says how it is sharded, so that gradient clipping,
optimizers and checkpoints can treat it right without knowing the layer:

* ``tensor_model_parallel``: True when each TP rank holds a different slice;
* ``partition_dim``: the dimension the full tensor is split along (-1 when replicated);
* ``partition_stride``: rank r holds chunks ``r, r + tp, r + 2 tp, ...`` of ``tp * stride``
  equal chunks along ``partition_dim`` (1: one contiguous slice);
* ``sequence_parallel_enabled``: a replicated parameter that only sees this rank's sequence
  shard (norm weights under sequence parallelism): its gradient must be summed over TP;
* ``tensor_parallel_replicas``: how many copies of each element exist across the TP shards
  (K/V projections replicated by ``kv_size_multiplier``); 1 when absent; a 1-D tensor of
  per-row counts along dim 0 for a fused QKV weight;
* ``tensor_parallel_padding``: set by ``pad_model`` on the parameters it padded, a
  :class:`nxd_layers.TensorParallelPadding` (the padded dim, its unpadded and padded global
  sizes, the layout and the TP degree it was padded at).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed import ProcessGroup

from nxd_state import collectives, get_parallel_state

__all__ = [
    "divide",
    "ensure_divisibility",
    "full_tensor",
    "gather_tensor_parallel_shards",
    "mark_sequence_parallel_parameter",
    "merge_shards",
    "param_is_not_tensor_parallel_duplicate",
    "pick_tensor_parallel_group",
    "resolve_tensor_parallel_group",
    "set_tensor_model_parallel_attributes",
    "shard_for_rank",
    "tensor_parallel_rank_and_size",
]

_TP_ATTRIBUTE_DEFAULTS: dict[str, object] = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def ensure_divisibility(numerator: int, denominator: int, what: str = "numerator") -> None:
    """Raise unless ``denominator`` divides ``numerator``, naming both values."""
    if denominator <= 0:
        raise ValueError(f"{what}: denominator must be positive, got {denominator}")
    if numerator % denominator != 0:
        raise ValueError(f"{what}({numerator}) is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must be exact (NxD's ``utils.divide``)."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1
) -> None:
    """Tag ``tensor`` with how it is sharded over TP (see the module docstring)."""
    tensor.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    tensor.partition_dim = dim  # type: ignore[attr-defined]
    tensor.partition_stride = stride  # type: ignore[attr-defined]


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give an untagged parameter the replicated defaults."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy the sharding attributes of ``source_tensor`` onto ``destination_tensor``."""
    for name in (
        *_TP_ATTRIBUTE_DEFAULTS,
        "sequence_parallel_enabled",
        "tensor_parallel_replicas",
        "tensor_parallel_padding",
    ):
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, tensor_parallel_rank: int | None = None
) -> bool:
    """True if this rank's copy of ``param`` counts once over TP (sharded, or TP rank 0).

    ``tensor_parallel_rank`` defaults to this process's rank in the current TP group (NxD's
    one-argument form)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if tensor_parallel_rank is None:
        tensor_parallel_rank = get_parallel_state().tensor_parallel_rank
    return tensor_parallel_rank == 0


def mark_sequence_parallel_parameter(param: torch.Tensor) -> torch.Tensor:
    """Mark a replicated parameter whose gradient is partial per sequence shard; returns it."""
    param.sequence_parallel_enabled = True  # type: ignore[attr-defined]
    return param


def resolve_tensor_parallel_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, else the TP group of the current nxd_state parallel state."""
    if group is not None:
        return group
    return get_parallel_state().tensor_parallel_group


def pick_tensor_parallel_group(
    tensor_parallel_group: ProcessGroup | None,
    tensor_model_parallel_group: ProcessGroup | None,
    owner: str,
) -> ProcessGroup:
    """The group a layer was given under nxd's name or NxD's (``tensor_model_parallel_group``),
    else the current TP group; an error if both name different groups."""
    if (
        tensor_parallel_group is not None
        and tensor_model_parallel_group is not None
        and tensor_parallel_group is not tensor_model_parallel_group
    ):
        raise ValueError(
            f"{owner}: tensor_parallel_group and tensor_model_parallel_group (NxD's name for the "
            "same argument) name different groups; pass one of them"
        )
    if tensor_parallel_group is None:
        tensor_parallel_group = tensor_model_parallel_group
    return resolve_tensor_parallel_group(tensor_parallel_group)


def tensor_parallel_rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in the TP group ``group`` (None: the current one)."""
    resolved = resolve_tensor_parallel_group(group)
    return collectives.group_rank(resolved), collectives.group_size(resolved)


def shard_for_rank(
    full: torch.Tensor, dim: int, rank: int, world_size: int, stride: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s shard: chunks ``rank, rank + n, ...`` of ``n * stride`` along ``dim``."""
    ensure_divisibility(full.shape[dim], world_size * stride, f"size of dim {dim}")
    chunks = full.chunk(world_size * stride, dim=dim)
    return torch.cat(chunks[rank::world_size], dim=dim)


def merge_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_for_rank`: the full tensor from every rank's shard, in order."""
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def gather_tensor_parallel_shards(
    shard: torch.Tensor, partition_dim: int, stride: int = 1, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The full tensor from every TP rank's ``shard`` (inverse of :func:`shard_for_rank`)."""
    resolved = resolve_tensor_parallel_group(group)
    gathered = collectives.all_gather(
        shard.detach().contiguous(), group=resolved, dim=partition_dim
    )
    if stride == 1:
        return gathered
    return merge_shards(
        list(gathered.chunk(collectives.group_size(resolved), dim=partition_dim)),
        partition_dim,
        stride,
    )


def full_tensor(
    param: torch.Tensor, tensor: torch.Tensor | None = None, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The unsharded value of ``tensor`` (default: ``param`` itself, e.g. pass ``param.grad``)
    laid out as ``param``'s sharding attributes say; replicated parameters come back as is."""
    value = param if tensor is None else tensor
    if not getattr(param, "tensor_model_parallel", False):
        return value.detach()
    return gather_tensor_parallel_shards(
        value,
        param.partition_dim,  # type: ignore[attr-defined]  # sharding attribute set on the tensor
        getattr(param, "partition_stride", 1),
        group,
    )


class _SharedHandle:
    """Holds a process group; copies share it (a group is a process-wide handle, not data)."""

    __slots__ = ("group",)

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, object]) -> _SharedHandle:
        return self


class ParallelModuleMixin:
    """For modules of parallel layers: a ``tensor_parallel_group`` attribute and a deepcopy
    that keeps the sharding attributes of the parameters.

    ``copy.deepcopy`` of a module would fail on the process group (it cannot be pickled) and
    ``nn.Parameter.__deepcopy__`` drops Python attributes; here copies share the group and
    their parameters carry the same attributes as the originals.
    """

    _tensor_parallel_handle: _SharedHandle
    _parameters: dict[str, torch.nn.Parameter | None]

    @property
    def tensor_parallel_group(self) -> ProcessGroup:
        return self._tensor_parallel_handle.group

    @tensor_parallel_group.setter
    def tensor_parallel_group(self, group: ProcessGroup) -> None:
        self._tensor_parallel_handle = _SharedHandle(group)

    def __deepcopy__(self, memo: dict[int, object]) -> ParallelModuleMixin:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            object.__setattr__(new, key, copy.deepcopy(value, memo))
        for name, param in self._parameters.items():
            copied = new._parameters[name]
            if param is not None and copied is not None:
                for key, value in vars(param).items():
                    if not hasattr(copied, key):
                        setattr(copied, key, value)
        return new
