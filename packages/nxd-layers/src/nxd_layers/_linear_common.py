"""What the parallel linear layers share: input checks, the sharded (optionally padded) weight,
the bias initialisation, and collectives done in a chosen dtype (NxD's ``reduce_dtype``).

``reduce_dtype`` (checked here, applied by the layers and :mod:`nxd_layers.mappings`): the
partial sums a TP reduction adds (forward all-reduce / reduce-scatter of a row-parallel output;
backward all-reduce / reduce-scatter of a column-parallel input gradient) are cast to it
before the collective and back afterwards, so e.g. a bf16 model sums its partials in float32
(NxD's default). A dtype equal to the tensor's adds nothing to the graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nxd_layers._attributes import (
    ParallelModuleMixin,
    divide,
    set_tensor_model_parallel_attributes,
    shard_for_rank,
    tensor_parallel_rank_and_size,
)
from nxd_layers._init import InitMethod, init_master, is_meta, sharded_parameter

__all__ = [
    "bias_init",
    "check_input",
    "check_reduce_dtype",
    "check_reinitialisable",
    "check_sizes",
    "copy_local_slice",
    "padded_master",
    "sharded_weight",
]


def check_input(
    module: nn.Module, x: torch.Tensor, features: int, needs_3d: bool, sequence_dimension: int
) -> None:
    """Raise early, naming the layer and the expected shape, on an input it cannot take."""
    name = type(module).__name__
    if needs_3d and x.dim() != 3:
        raise ValueError(
            f"{name} with sequence_parallel_enabled=True needs a 3-D input "
            f"(sequence dim {sequence_dimension}, features last), got shape {tuple(x.shape)}"
        )
    if x.dim() == 0 or x.shape[-1] != features:
        raise ValueError(
            f"{name} expects the last dim of its input to be {features}, got shape {tuple(x.shape)}"
        )


def check_sizes(name: str, **sizes: int) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: {key} must be a positive int, got {value!r}")


def check_reduce_dtype(name: str, reduce_dtype: Any) -> torch.dtype:
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise ValueError(
            f"{name}: reduce_dtype must be a floating-point torch.dtype, got {reduce_dtype!r}"
        )
    return reduce_dtype


def bias_init(fan_in: int) -> InitMethod:
    """b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as ``torch.nn.Linear``."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda bias: nn.init.uniform_(bias, -bound, bound)


def padded_master(
    shape: tuple[int, ...], init_method: InitMethod | None, dim: int, pad_size: int
) -> torch.Tensor:
    """The full tensor of ``shape`` drawn from the seed, then ``pad_size`` zeros appended along
    ``dim`` (so the unpadded part is what an unpadded layer draws)."""
    master = init_master(shape, init_method)
    if not pad_size:
        return master
    widths = [0, 0] * (len(shape) - 1 - dim) + [0, pad_size]
    return F.pad(master, widths)


def sharded_weight(
    full_shape: tuple[int, int],
    partition_dim: int,
    rank: int,
    tp: int,
    stride: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
    init_method: InitMethod,
    pad_size: int = 0,
) -> tuple[nn.Parameter, torch.Tensor | None]:
    """This rank's slice of W (``full_shape`` = (out, in), before padding) along
    ``partition_dim``, tagged; ``pad_size`` zero rows/columns are appended to W first.

    W is built whole from the seed and sliced (none on the meta device), so every TP degree
    holds the same model; the master is returned for ``keep_master_weight``.
    """
    master = None
    if not is_meta(device):
        master = padded_master(full_shape, init_method, partition_dim, pad_size)
    shard_shape = list(full_shape)
    shard_shape[partition_dim] = divide(full_shape[partition_dim] + pad_size, tp)
    weight = sharded_parameter(
        master,
        tuple(shard_shape),
        partition_dim=partition_dim,
        rank=rank,
        world_size=tp,
        stride=stride,
        dtype=dtype,
        device=device,
    )
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    return weight, master


def check_reinitialisable(owner: nn.Module, what: str, *params: torch.Tensor | None) -> None:
    """Refuse, before anything is drawn, to re-initialise parameters that cannot take a fresh
    draw: a meta parameter (not materialised yet) or one ``pad_model`` padded (its shard holds
    zeros the drawn tensor has no place for). ``what`` names the method in the error."""
    name = f"{type(owner).__name__}.{what}"
    for param in params:
        if param is None:
            continue
        if param.is_meta:
            raise ValueError(
                f"{name}: the parameter is on the meta device; materialise it first "
                f"(e.g. module.to_empty(device='cpu')), then initialise"
            )
        if getattr(param, "tensor_parallel_padding", None) is not None:
            raise ValueError(
                f"{name}: the parameter was padded by pad_model; initialise the layer before "
                f"padding it"
            )


def copy_local_slice(
    owner: ParallelModuleMixin,
    what: str,
    param: torch.Tensor,
    master: torch.Tensor,
    partition_dim: int | None,
    stride: int = 1,
) -> None:
    """param <- this rank's slice of the full ``master`` along ``partition_dim`` (the whole of
    it when None), in place: the parameter object stays (optimizers keep their references).

    What the layers' re-initialisation (NxD's ``init_weight_cpu`` / ``initialize_weight_biases``)
    shares, after :func:`check_reinitialisable`; ``what`` names the method in the errors.
    ``master`` is drawn on CPU, so the copy also casts and moves it to the parameter's dtype
    and device.
    """
    local = master
    if partition_dim is not None:
        rank, tp = tensor_parallel_rank_and_size(owner.tensor_parallel_group)
        local = shard_for_rank(master, partition_dim, rank, tp, stride)
    if tuple(local.shape) != tuple(param.shape):
        raise ValueError(
            f"{type(owner).__name__}.{what}: this rank's slice of the re-drawn tensor has shape "
            f"{tuple(local.shape)}, the parameter {tuple(param.shape)} (was the layer resized "
            f"after construction?)"
        )
    with torch.no_grad():
        param.copy_(local)
