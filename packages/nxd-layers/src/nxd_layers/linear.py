"""Column- and row-parallel linear layers (Megatron's split of Y = XA + b over TP ranks).

Weights are stored as in ``torch.nn.Linear`` (``W = A^T``, shape ``(out, in)``), so
``Y = X W^T + b``. ColumnParallelLinear splits W along its rows (A's columns), RowParallelLinear
along its columns (A's rows); a Column followed by a Row needs one all-reduce forward and one
backward, or under sequence parallelism one all-gather and one reduce-scatter each way.
Both derive from :class:`BaseParallelLinear`, NxD's common base (as does the GQA QKV layer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from nxd_layers import mappings
from nxd_layers._attributes import (
    ParallelModuleMixin,
    divide,
    mark_sequence_parallel_parameter,
    merge_shards,
    pick_tensor_parallel_group,
    set_tensor_model_parallel_attributes,
    tensor_parallel_rank_and_size,
)
from nxd_layers._init import (
    InitMethod,
    default_linear_init,
    init_master,
    is_meta,
    sharded_parameter,
)

__all__ = ["BaseParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "check_input"]


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


def _check_sizes(name: str, **sizes: int) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: {key} must be a positive int, got {value!r}")


def _bias_init(fan_in: int) -> InitMethod:
    """b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as ``torch.nn.Linear``."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda bias: nn.init.uniform_(bias, -bound, bound)


def _sharded_weight(
    full_shape: tuple[int, int],
    partition_dim: int,
    rank: int,
    tp: int,
    stride: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
    init_method: InitMethod,
) -> tuple[nn.Parameter, torch.Tensor | None]:
    """This rank's slice of W (``full_shape`` = (out, in)) along ``partition_dim``, tagged.

    W is built whole from the seed and sliced (none on the meta device), so every TP degree
    holds the same model; the master is returned for ``keep_master_weight``.
    """
    master = None if is_meta(device) else init_master(full_shape, init_method)
    shard_shape = list(full_shape)
    shard_shape[partition_dim] = divide(full_shape[partition_dim], tp)
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


class BaseParallelLinear(ParallelModuleMixin, nn.Module):
    """The base NxD's tensor-parallel linear layers share (``isinstance`` checks in user code).

    Holds the TP group (``tensor_parallel_group``, shared by deep copies) and NxD's
    initialisation hooks: ``arg_init_method`` (the ``init_method`` argument, None for
    ``torch.nn.Linear``'s default) applied by :meth:`_init_weight`.
    """

    arg_init_method: InitMethod | None = None

    def _init_weight(self, weight: torch.Tensor) -> None:
        """W <- init_method(W), or U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as ``torch.nn.Linear``."""
        (self.arg_init_method or default_linear_init)(weight)


class ColumnParallelLinear(BaseParallelLinear):
    """Y = X A + b, A split along its columns: A = [A_1, ..., A_p], Y_i = X A_i + b_i.

    ``weight`` is this rank's ``(output_size / tp, input_size)`` slice of W = A^T. With
    ``gather_output`` every rank gets Y = [X A_1, ..., X A_p] + b: as in NxD the bias is then
    the full ``(output_size,)`` vector, replicated on every rank (not TP-sharded, so gradient
    norms count it once) and added after the gather; without it each rank gets Y_i and holds
    its ``(output_size / tp,)`` slice b_i. With ``stride`` > 1 the gathered features are put
    back in W's order. With ``sequence_parallel_enabled`` the 3-D input is this rank's
    sequence shard and is all-gathered along ``sequence_dimension`` first. ``skip_bias_add``
    returns ``(Y without bias, bias)`` for fusing the add later.
    ``tensor_model_parallel_group`` is NxD's name for ``tensor_parallel_group``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        sequence_parallel_enabled: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        stride: int = 1,
        init_method: InitMethod | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        sequence_dimension: int = 0,
        tensor_parallel_group: ProcessGroup | None = None,
        *,
        tensor_model_parallel_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _check_sizes(type(self).__name__, input_size=input_size, output_size=output_size)
        self.tensor_parallel_group = pick_tensor_parallel_group(
            tensor_parallel_group, tensor_model_parallel_group, type(self).__name__
        )
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        if output_size % (tp * stride) != 0:
            raise ValueError(
                f"ColumnParallelLinear: output_size({output_size}) is not divisible by "
                f"tensor_parallel_size({tp}) x stride({stride})"
            )
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, tp)
        self.tensor_parallel_size = tp
        self.gather_output = gather_output
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.arg_init_method = init_method

        meta = is_meta(device)
        self.weight, master = _sharded_weight(
            (output_size, input_size), 0, rank, tp, stride, dtype, device, self._init_weight
        )
        self.master_weight = master if keep_master_weight else None
        if bias:
            master_bias = None if meta else init_master((output_size,), _bias_init(input_size))
            sharded = not gather_output  # NxD: a gathered output gets the full, replicated bias
            self.bias = sharded_parameter(
                master_bias,
                (self.output_size_per_partition if sharded else output_size,),
                partition_dim=0 if sharded else None,
                rank=rank,
                world_size=tp,
                stride=stride,
                dtype=dtype,
                device=device,
            )
            set_tensor_model_parallel_attributes(
                self.bias, sharded, 0 if sharded else -1, stride if sharded else 1
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        check_input(
            self, x, self.input_size, self.sequence_parallel_enabled, self.sequence_dimension
        )
        group = self.tensor_parallel_group
        if self.sequence_parallel_enabled:
            x = mappings.gather_from_sequence_parallel_region(
                x, self.sequence_dimension, process_group=group
            )
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x, group)
        local_bias = None if self.skip_bias_add or self.gather_output else self.bias
        y = F.linear(x, self.weight, local_bias)
        if self.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y, group)
            if self.stride > 1:  # rank-major [Y_0 | Y_1 | ...] back to W's feature order
                shards = list(y.chunk(self.tensor_parallel_size, dim=-1))
                y = merge_shards(shards, y.dim() - 1, self.stride)
            if self.bias is not None and not self.skip_bias_add:
                y = y + self.bias
        if self.skip_bias_add:
            return y, self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size} "
            f"(per partition {self.output_size_per_partition}), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, "
            f"sequence_parallel_enabled={self.sequence_parallel_enabled}"
        )


class RowParallelLinear(BaseParallelLinear):
    """Y = X A + b, A split along its rows and X along its columns: Y = sum_i X_i A_i + b.

    ``weight`` is this rank's ``(output_size, input_size / tp)`` slice of W = A^T; the bias is
    replicated and added after the reduction. ``input_is_parallel`` says X arrives already
    split (the output of a ColumnParallelLinear without ``gather_output``). With
    ``sequence_parallel_enabled`` the partial sums are reduce-scattered along
    ``sequence_dimension`` instead of all-reduced (the bias is then marked sequence-parallel:
    its gradient must be summed over TP with ``allreduce_sequence_parallel_gradients``).
    ``tensor_model_parallel_group`` is NxD's name for ``tensor_parallel_group``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        sequence_parallel_enabled: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        stride: int = 1,
        init_method: InitMethod | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        sequence_dimension: int = 0,
        tensor_parallel_group: ProcessGroup | None = None,
        *,
        tensor_model_parallel_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _check_sizes(type(self).__name__, input_size=input_size, output_size=output_size)
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel_enabled=True requires "
                "input_is_parallel=True (the input must come from a column-parallel layer)"
            )
        self.tensor_parallel_group = pick_tensor_parallel_group(
            tensor_parallel_group, tensor_model_parallel_group, type(self).__name__
        )
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        if input_size % (tp * stride) != 0:
            raise ValueError(
                f"RowParallelLinear: input_size({input_size}) is not divisible by "
                f"tensor_parallel_size({tp}) x stride({stride})"
            )
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, tp)
        self.tensor_parallel_size = tp
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.arg_init_method = init_method

        meta = is_meta(device)
        self.weight, master = _sharded_weight(
            (output_size, input_size), 1, rank, tp, stride, dtype, device, self._init_weight
        )
        self.master_weight = master if keep_master_weight else None
        if bias:
            master_bias = None if meta else init_master((output_size,), _bias_init(input_size))
            self.bias = sharded_parameter(
                master_bias,
                (output_size,),
                partition_dim=None,
                rank=rank,
                world_size=tp,
                dtype=dtype,
                device=device,
            )
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            if sequence_parallel_enabled:
                mark_sequence_parallel_parameter(self.bias)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        expected = self.input_size_per_partition if self.input_is_parallel else self.input_size
        check_input(self, x, expected, self.sequence_parallel_enabled, self.sequence_dimension)
        group = self.tensor_parallel_group
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel_enabled:
            y = mappings.reduce_scatter_to_sequence_parallel_region(
                partial, self.sequence_dimension, process_group=group
            )
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(partial, group)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size} (per partition {self.input_size_per_partition}), "
            f"output_size={self.output_size}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel_enabled={self.sequence_parallel_enabled}"
        )
