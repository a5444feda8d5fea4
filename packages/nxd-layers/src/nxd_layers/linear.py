"""Column- and row-parallel linear layers (Megatron's split of Y = XA + b over TP ranks).

Weights are stored as in ``torch.nn.Linear`` (``W = A^T``, shape ``(out, in)``), so
``Y = X W^T + b``. ColumnParallelLinear splits W along its rows (A's columns), RowParallelLinear
along its columns (A's rows); a Column followed by a Row needs one all-reduce forward and one
backward, or under sequence parallelism one all-gather and one reduce-scatter each way.
Both derive from :class:`BaseParallelLinear`, NxD's common base (as does the GQA QKV layer).
"""

from __future__ import annotations

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
from nxd_layers._init import InitMethod, default_linear_init, is_meta, sharded_parameter
from nxd_layers._linear_common import (
    bias_init,
    check_input,
    check_reduce_dtype,
    check_reinitialisable,
    check_sizes,
    copy_local_slice,
    padded_master,
    sharded_weight,
)
from nxd_layers.utils import get_padding_length

__all__ = ["BaseParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "check_input"]


def _pad_size(name: str, what: str, size: int, tp: int, stride: int, pad: bool) -> int:
    """Zeros appended to ``size`` (NxD's ``pad``), or an error if it must be padded and is not."""
    pad_size = get_padding_length(size, tp) if pad else 0
    if (size + pad_size) % (tp * stride) != 0:
        hint = "" if pad or stride > 1 else "; pass pad=True to pad it with zeros"
        raise ValueError(
            f"{name}: {what}({size + pad_size}) is not divisible by "
            f"tensor_parallel_size({tp}) x stride({stride}){hint}"
        )
    return pad_size


def _pad_state_dict_entry(
    owner: BaseParallelLinear, model_state_dict: dict[str, torch.Tensor], prefix: str, dim: int
) -> None:
    """Zero-pad the full tensor ``model_state_dict[prefix]`` along ``dim`` to the padded size."""
    full = model_state_dict[prefix]
    if not owner.pad_size or full.dim() <= dim:
        return
    unpadded = getattr(owner, "output_size" if dim == 0 else "input_size") - owner.pad_size
    if full.shape[dim] != unpadded:
        raise ValueError(
            f"{type(owner).__name__}.preshard_hook: {prefix} has size {full.shape[dim]} along "
            f"dim {dim}, expected the unpadded {unpadded}"
        )
    widths = [0, 0] * (full.dim() - 1 - dim) + [0, owner.pad_size]
    model_state_dict[prefix] = F.pad(full, widths)


class BaseParallelLinear(ParallelModuleMixin, nn.Module):
    """The base NxD's tensor-parallel linear layers share (``isinstance`` checks in user code).

    Holds the TP group (``tensor_parallel_group``, shared by deep copies) and NxD's
    initialisation hooks: ``arg_init_method`` (the ``init_method`` argument, None for
    ``torch.nn.Linear``'s default) applied by :meth:`_init_weight`. ``pad`` / ``pad_size``:
    NxD's zero padding of the sharded dimension to a multiple of the TP degree.
    """

    arg_init_method: InitMethod | None = None
    pad: bool = False
    pad_size: int = 0
    stride: int = 1

    def _init_weight(self, weight: torch.Tensor) -> None:
        """W <- init_method(W), or U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as ``torch.nn.Linear``."""
        (self.arg_init_method or default_linear_init)(weight)

    def _build_weight(
        self,
        full_shape: tuple[int, int],
        partition_dim: int,
        *,
        rank: int,
        tp: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
        keep_master_weight: bool,
    ) -> None:
        """W <- init_method(W) drawn full (``full_shape``, unpadded; the layer's ``pad_size``
        zeros appended along ``partition_dim``), this rank's slice kept as ``weight``, the
        full one as ``master_weight`` with ``keep_master_weight``."""
        self.weight, master = sharded_weight(
            full_shape,
            partition_dim,
            rank,
            tp,
            self.stride,
            dtype,
            device,
            self._init_weight,
            self.pad_size,
        )
        self.keep_master_weight = keep_master_weight
        self.master_weight = master if keep_master_weight else None

    def _build_bias(
        self,
        input_size: int,
        output_size: int,
        pad_size: int,
        *,
        split: bool,
        rank: int,
        tp: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        """b ~ U(-1/sqrt(input_size), 1/sqrt(input_size)) as ``torch.nn.Linear`` draws it,
        ``pad_size`` zeros appended; split over TP along the output features (``split``, with
        the layer's stride) or replicated."""
        master = None
        if not is_meta(device):
            master = padded_master((output_size,), bias_init(input_size), 0, pad_size)
        full = output_size + pad_size
        stride = self.stride if split else 1
        self.bias = sharded_parameter(
            master,
            (divide(full, tp) if split else full,),
            partition_dim=0 if split else None,
            rank=rank,
            world_size=tp,
            stride=stride,
            dtype=dtype,
            device=device,
        )
        set_tensor_model_parallel_attributes(self.bias, split, 0 if split else -1, stride)


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

    NxD's ``pad``: ``output_size`` is padded with zero rows of W (and zero bias) to a multiple
    of TP (``output_size`` becomes the padded size, ``pad_size`` the zeros); a gathered output
    is narrowed back to the unpadded width, an ungathered one keeps the zero features (feed it
    to a ``RowParallelLinear(pad=True, input_is_parallel=True)``). ``preshard_hook`` pads a
    full, unpadded checkpoint tensor. ``reduce_dtype``: the backward all-reduce (reduce-scatter
    under SP) of the input gradient is done in this dtype. ``tensor_model_parallel_group`` is
    NxD's name for ``tensor_parallel_group``.
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
        pad: bool = False,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_sizes(name, input_size=input_size, output_size=output_size)
        self.reduce_dtype = check_reduce_dtype(name, reduce_dtype)
        self.tensor_parallel_group = pick_tensor_parallel_group(
            tensor_parallel_group, tensor_model_parallel_group, name
        )
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        self.pad = pad
        self.pad_size = _pad_size(name, "output_size", output_size, tp, stride, pad)
        self.input_size, self.output_size = input_size, output_size + self.pad_size
        self.output_size_per_partition = divide(self.output_size, tp)
        self.tensor_parallel_size = tp
        self.gather_output = gather_output
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.arg_init_method = init_method

        self._build_weight(
            (output_size, input_size), 0, rank=rank, tp=tp, dtype=dtype, device=device,
            keep_master_weight=keep_master_weight,
        )  # fmt: skip
        if bias:  # NxD: a gathered output gets the full, replicated bias
            self._build_bias(
                input_size, output_size, self.pad_size, split=not gather_output,
                rank=rank, tp=tp, dtype=dtype, device=device,
            )  # fmt: skip
        else:
            self.register_parameter("bias", None)

    def init_weight_cpu(self) -> None:
        """W <- init_method(W) re-drawn (NxD's re-initialisation after meta-device building).

        The full ``(output_size, input_size)`` weight is drawn on CPU in float32 from the
        current seed exactly as the constructor draws it (the same values for the same seed,
        at any TP degree; padded rows zero) and this rank's rows are copied into ``weight`` in
        place. The bias is left as it is (NxD's models zero it themselves);
        ``master_weight`` is the new full weight with ``keep_master_weight``, else None.
        """
        full_shape = (self.output_size - self.pad_size, self.input_size)
        check_reinitialisable(self, "init_weight_cpu", self.weight)
        master = padded_master(full_shape, self._init_weight, 0, self.pad_size)
        copy_local_slice(self, "init_weight_cpu", self.weight, master, 0, self.stride)
        self.master_weight = master if self.keep_master_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        check_input(
            self, x, self.input_size, self.sequence_parallel_enabled, self.sequence_dimension
        )
        group = self.tensor_parallel_group
        if self.sequence_parallel_enabled:
            x = mappings.gather_from_sequence_parallel_region(
                x, self.sequence_dimension, process_group=group, dtype=self.reduce_dtype
            )
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x, group, dtype=self.reduce_dtype)
        local_bias = None if self.skip_bias_add or self.gather_output else self.bias
        y = F.linear(x, self.weight, local_bias)
        if not self.gather_output:
            return (y, self.bias) if self.skip_bias_add else y
        y = mappings.gather_from_tensor_model_parallel_region(y, group)
        if self.stride > 1:  # rank-major [Y_0 | Y_1 | ...] back to W's feature order
            shards = list(y.chunk(self.tensor_parallel_size, dim=-1))
            y = merge_shards(shards, y.dim() - 1, self.stride)
        if self.pad_size:  # the zero features go; the bias keeps NxD's padded shape
            y = y.narrow(-1, 0, self.output_size - self.pad_size)
        bias: torch.Tensor | None = self.bias
        if bias is not None and self.pad_size:
            bias = bias.narrow(0, 0, self.output_size - self.pad_size)
        if self.skip_bias_add:
            return y, self.bias
        return y + bias if bias is not None else y

    def preshard_hook(self, model_state_dict: dict[str, torch.Tensor], prefix: str) -> None:
        """Zero-pad the full, unpadded ``model_state_dict[prefix]`` (weight or bias) along
        dim 0 to the padded ``output_size``, before it is sliced (NxD's loading hook)."""
        _pad_state_dict_entry(self, model_state_dict, prefix, 0)

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size} "
            f"(per partition {self.output_size_per_partition}, pad {self.pad_size}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
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

    NxD's ``pad``: ``input_size`` is padded with zero columns of W to a multiple of TP (an
    unsplit input is zero-padded before it is split; a split one must have the padded width).
    ``reduce_dtype``: the forward all-reduce / reduce-scatter of the partial sums happens in
    this dtype (the result is cast back), and under SP the backward all-gather of the
    gradient too. ``reduce_output=False`` (NxD's): no reduction, each rank returns its partial
    sum X_r A_r with the bias added (sum the partials yourself, then add b once: pass
    ``bias=False`` or ``skip_bias_add``). ``tensor_model_parallel_group`` is NxD's name for
    ``tensor_parallel_group``.
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
        pad: bool = False,
        reduce_dtype: torch.dtype = torch.float32,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_sizes(name, input_size=input_size, output_size=output_size)
        self.reduce_dtype = check_reduce_dtype(name, reduce_dtype)
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel_enabled=True requires "
                "input_is_parallel=True (the input must come from a column-parallel layer)"
            )
        self.tensor_parallel_group = pick_tensor_parallel_group(
            tensor_parallel_group, tensor_model_parallel_group, name
        )
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        self.pad = pad
        self.pad_size = _pad_size(name, "input_size", input_size, tp, stride, pad)
        self.input_size, self.output_size = input_size + self.pad_size, output_size
        self.input_size_per_partition = divide(self.input_size, tp)
        self.tensor_parallel_size = tp
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.skip_bias_add = skip_bias_add
        self.reduce_output = reduce_output
        self.stride = stride
        self.arg_init_method = init_method

        self._build_weight(
            (output_size, input_size), 1, rank=rank, tp=tp, dtype=dtype, device=device,
            keep_master_weight=keep_master_weight,
        )  # fmt: skip
        if bias:  # replicated, added after the reduction
            self._build_bias(
                input_size, output_size, 0, split=False, rank=rank, tp=tp, dtype=dtype,
                device=device,
            )  # fmt: skip
            if sequence_parallel_enabled:
                mark_sequence_parallel_parameter(self.bias)
        else:
            self.register_parameter("bias", None)

    def init_weight_cpu(self) -> None:
        """W <- init_method(W) re-drawn (NxD's re-initialisation after meta-device building).

        The full ``(output_size, input_size)`` weight is drawn on CPU in float32 from the
        current seed exactly as the constructor draws it (padded columns zero) and this rank's
        columns are copied into ``weight`` in place; the bias is left as it is;
        ``master_weight`` is the new full weight with ``keep_master_weight``, else None.
        """
        full_shape = (self.output_size, self.input_size - self.pad_size)
        check_reinitialisable(self, "init_weight_cpu", self.weight)
        master = padded_master(full_shape, self._init_weight, 1, self.pad_size)
        copy_local_slice(self, "init_weight_cpu", self.weight, master, 1, self.stride)
        self.master_weight = master if self.keep_master_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if self.input_is_parallel:
            expected = self.input_size_per_partition
        else:
            expected = self.input_size - self.pad_size
        check_input(self, x, expected, self.sequence_parallel_enabled, self.sequence_dimension)
        group = self.tensor_parallel_group
        if not self.input_is_parallel:
            if self.pad_size:
                x = F.pad(x, (0, self.pad_size))
            x = mappings.scatter_to_tensor_model_parallel_region(x, group)
        y = F.linear(x, self.weight)
        if self.reduce_output:
            y = self._reduce(y)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of the partials over TP (reduce-scattered under SP), in ``reduce_dtype``."""
        group, dtype = self.tensor_parallel_group, partial.dtype
        summand = partial.to(self.reduce_dtype)
        if self.sequence_parallel_enabled:
            y = mappings.reduce_scatter_to_sequence_parallel_region(
                summand, self.sequence_dimension, process_group=group, dtype=self.reduce_dtype
            )
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(summand, group)
        return y.to(dtype)

    def preshard_hook(self, model_state_dict: dict[str, torch.Tensor], prefix: str) -> None:
        """Zero-pad the full, unpadded weight ``model_state_dict[prefix]`` along dim 1 to the
        padded ``input_size`` before it is sliced (NxD's loading hook; a bias is left as is)."""
        _pad_state_dict_entry(self, model_state_dict, prefix, 1)

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size} (per partition {self.input_size_per_partition}, "
            f"pad {self.pad_size}), output_size={self.output_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel_enabled={self.sequence_parallel_enabled}, "
            f"reduce_output={self.reduce_output}"
        )
