"""2-D convolutions split over TP along the output or the input channels (NxD's parallel convs).

A convolution is linear in its channels: Y[o] = sum_c W[o, c] * X[c] + b[o]. Splitting W along
the output channels (dim 0) gives each rank whole output channels Y[o in O_i] (an all-gather
along dim 1 assembles Y); splitting along the input channels (dim 1) gives each rank a partial
sum over its channels C_i, summed over TP (an all-reduce) before the bias is added. Like
Column -> Row linears, an output-channel conv without ``gather_output`` feeds an
input-channel conv with ``input_is_parallel`` with one all-reduce forward and one backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from nxd_layers import mappings
from nxd_layers._attributes import (
    ParallelModuleMixin,
    divide,
    pick_tensor_parallel_group,
    set_tensor_model_parallel_attributes,
    tensor_parallel_rank_and_size,
)
from nxd_layers._init import InitMethod, init_master, is_meta, sharded_parameter
from nxd_layers.utils import get_padding_length

__all__ = ["BaseParallelConv", "InputChannelParallelConv2d", "OutputChannelParallelConv2d"]

# A conv kernel is [c_out, c_in, *kernel]: the dims the two layers split.
CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION = 0
CONV_KERNEL_INPUT_CHANNEL_DIMENSION = 1


def _pair(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return (value[0], value[1])
    raise TypeError(f"{name} must be an int or a tuple of two ints, got {value!r}")


def _padding(value: Any) -> tuple[int, int] | str:
    if isinstance(value, str):
        return value  # "same" / "valid", as nn.Conv2d
    return _pair(value, "padding")


def _check_conv(
    name: str, in_channels: int, out_channels: int, groups: int, padding_mode: str
) -> None:
    """What nxd's (and NxD's) parallel convolutions do not implement, and bad channel counts."""
    if groups != 1:
        raise NotImplementedError(f"{name}: groups must be 1, got {groups}")
    if padding_mode != "zeros":
        raise NotImplementedError(f"{name}: padding_mode must be 'zeros', got {padding_mode!r}")
    for key, value in (("in_channels", in_channels), ("out_channels", out_channels)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: {key} must be a positive int, got {value!r}")


class BaseParallelConv(ParallelModuleMixin, nn.Module):
    """Weight ``[c_out, c_in, kh, kw]`` split along ``partition_dim`` (0: output channels,
    1: input channels) over TP; the master kernel is drawn from the seed as ``nn.Conv2d``
    draws it (kaiming-uniform, a=sqrt(5); bias U(+-1/sqrt(c_in kh kw))) and sliced, so every TP
    degree builds the same convolution. ``partition_pad`` appends zero channels up to a
    multiple of the TP size along the split dim. ``groups`` other than 1 and padding modes
    other than ``"zeros"`` are not supported (as in NxD); ``dilation`` is.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int],
        padding: int | tuple[int, int] | str,
        dilation: int | tuple[int, int],
        groups: int,
        bias: bool,
        padding_mode: str,
        partition_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
        init_method: InitMethod | None,
        keep_master_params: bool,
        partition_pad: bool,
        tensor_parallel_group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        _check_conv(name, in_channels, out_channels, groups, padding_mode)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.padding = _padding(padding)
        self.dilation = _pair(dilation, "dilation")
        self.groups, self.padding_mode = groups, padding_mode
        self.partition_dim, self.dtype = partition_dim, dtype
        self.arg_init_method = init_method
        self.keep_master_params, self.partition_pad = keep_master_params, partition_pad
        self.tensor_parallel_group = pick_tensor_parallel_group(tensor_parallel_group, None, name)
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        self.tensor_parallel_size = tp
        local = self._partition(in_channels, out_channels)

        master_weight = master_bias = None
        if not is_meta(device):
            master_weight, master_bias = self._draw_master(in_channels, out_channels, bias)
        self.weight = sharded_parameter(
            master_weight,
            local,
            partition_dim=partition_dim,
            rank=rank,
            world_size=tp,
            dtype=dtype,
            device=device,
        )
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, 1)
        self.master_weight = master_weight if keep_master_params else None
        self.master_bias = master_bias if keep_master_params else None
        if bias:
            self._build_bias(master_bias, rank, tp, dtype, device)
        else:
            self.register_parameter("bias", None)

    def _build_bias(
        self,
        master_bias: torch.Tensor | None,
        rank: int,
        tp: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        """This rank's bias from the full ``master_bias`` (``None`` on the meta device).

        Output-channel split: the bias is split with the channels (added before the gather);
        input-channel split: replicated, added after the all-reduce.
        """
        bias_split = self.partition_dim == CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION
        self.bias = sharded_parameter(
            master_bias,
            (self.channels_per_partition if bias_split else self.out_channels,),
            partition_dim=0 if bias_split else None,
            rank=rank,
            world_size=tp,
            dtype=dtype,
            device=device,
        )
        set_tensor_model_parallel_attributes(self.bias, bias_split, 0 if bias_split else -1, 1)

    def _partition(self, in_channels: int, out_channels: int) -> tuple[int, ...]:
        """Pad the split channels to a multiple of TP (only with ``partition_pad``), set the
        padded ``in_channels`` / ``out_channels`` (as NxD keeps them) and
        ``channels_per_partition``; returns the local kernel's shape."""
        name, tp = type(self).__name__, self.tensor_parallel_size
        outputs_split = self.partition_dim == CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION
        split = out_channels if outputs_split else in_channels
        what = "out_channels" if outputs_split else "in_channels"
        self.partition_pad_size = get_padding_length(split, tp)
        if self.partition_pad_size and not self.partition_pad:
            raise ValueError(
                f"{name}: {what}({split}) is not divisible by tensor_parallel_size({tp}); "
                f"pass partition_pad=True to pad it to {split + self.partition_pad_size}"
            )
        full_in, full_out = in_channels, out_channels
        if outputs_split:
            full_out += self.partition_pad_size
        else:
            full_in += self.partition_pad_size
        self.in_channels, self.out_channels = full_in, full_out
        self.channels_per_partition = divide(split + self.partition_pad_size, tp)
        local = [full_out, full_in, *self.kernel_size]
        local[self.partition_dim] = self.channels_per_partition
        return tuple(local)

    def _draw_master(
        self, in_channels: int, out_channels: int, bias: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full (padded) kernel and bias from the seed, drawn as ``nn.Conv2d`` draws the
        unpadded ones; the padding channels are zeros."""
        fan_in = in_channels * math.prod(self.kernel_size)  # the unpadded conv's
        master_weight = torch.zeros((self.out_channels, self.in_channels, *self.kernel_size))
        master_weight[:out_channels, :in_channels] = init_master(
            (out_channels, in_channels, *self.kernel_size), self._init_weight
        )
        master_bias = None
        if bias:
            bound = 1.0 / math.sqrt(fan_in)
            master_bias = torch.zeros(self.out_channels)
            master_bias[:out_channels] = init_master(
                (out_channels,), lambda b: nn.init.uniform_(b, -bound, bound)
            )
        return master_weight, master_bias

    def _init_weight(self, weight: torch.Tensor) -> None:
        """W <- init_method(W), or ``nn.Conv2d``'s kaiming-uniform (a=sqrt(5))."""
        if self.arg_init_method is None:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            self.arg_init_method(weight)

    def _conv(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(x, self.weight, bias, self.stride, self.padding, self.dilation)

    def _check_input(self, x: torch.Tensor, channels: int) -> None:
        if x.dim() != 4 or x.shape[1] != channels:
            raise ValueError(
                f"{type(self).__name__} expects an [N, C, H, W] input with C = {channels}, got "
                f"shape {tuple(x.shape)}"
            )

    def preshard_hook(self, model_state_dict: dict[str, torch.Tensor], prefix: str) -> None:
        """Zero-pad the unpadded full kernel at ``model_state_dict[prefix]`` along the split
        channel dim to this layer's padded size (NxD's loading hook for ``partition_pad``)."""
        if not self.partition_pad_size:
            return
        full = model_state_dict[prefix]
        dim = self.partition_dim
        expected = self.weight.shape[dim] * self.tensor_parallel_size - self.partition_pad_size
        if full.shape[dim] != expected:
            raise ValueError(
                f"{type(self).__name__}.preshard_hook: {prefix} has {full.shape[dim]} channels "
                f"along dim {dim}, expected the unpadded {expected}"
            )
        widths = [0, 0] * full.dim()
        widths[2 * (full.dim() - 1 - dim) + 1] = self.partition_pad_size
        model_state_dict[prefix] = F.pad(full, widths)


class OutputChannelParallelConv2d(BaseParallelConv):
    """Y = conv(X, W) + b with W split along its output channels: Y[O_i] = conv(X, W_i) + b_i.

    ``weight``: ``[out / tp, in, kh, kw]``, ``bias``: ``[out / tp]`` (added before the gather).
    ``gather_output`` all-gathers Y along the channels (dim 1) on every rank (padded channels
    dropped); otherwise each rank keeps its ``[N, out / tp, H', W']`` channels, the input of an
    :class:`InputChannelParallelConv2d` with ``input_is_parallel``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        keep_master_weight: bool = False,
        partition_pad: bool = False,
        *,
        tensor_parallel_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            CONV_KERNEL_OUTPUT_CHANNEL_DIMENSION,
            dtype,
            device,
            init_method,
            keep_master_weight,
            partition_pad,
            tensor_parallel_group,
        )
        self.gather_output = gather_output

    def forward(self, in_tensor: torch.Tensor) -> torch.Tensor:
        self._check_input(in_tensor, self.in_channels)
        group = self.tensor_parallel_group
        x = mappings.copy_to_tensor_model_parallel_region(in_tensor, group)
        y = self._conv(x, self.bias)
        if not self.gather_output:
            return y
        y = mappings.gather_from_tensor_model_parallel_region_with_dim(y, 1, group)
        if self.partition_pad_size:
            y = y.narrow(1, 0, self.out_channels - self.partition_pad_size)
        return y


class InputChannelParallelConv2d(BaseParallelConv):
    """Y = sum_i conv(X_i, W_i) + b with W split along its input channels and X along dim 1.

    ``weight``: ``[out, in / tp, kh, kw]``; ``bias``: ``[out]``, replicated, added after the
    all-reduce. ``input_is_parallel``: X arrives as this rank's channels (the output of an
    :class:`OutputChannelParallelConv2d` without ``gather_output``); otherwise the full X is
    split here (zero channels appended first under ``partition_pad``).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        keep_master_weight: bool = False,
        partition_pad: bool = False,
        *,
        tensor_parallel_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            CONV_KERNEL_INPUT_CHANNEL_DIMENSION,
            dtype,
            device,
            init_method,
            keep_master_weight,
            partition_pad,
            tensor_parallel_group,
        )
        self.input_is_parallel = input_is_parallel

    def forward(self, in_tensor: torch.Tensor) -> torch.Tensor:
        group = self.tensor_parallel_group
        if self.input_is_parallel:
            self._check_input(in_tensor, self.channels_per_partition)
            x = in_tensor
        else:
            self._check_input(in_tensor, self.in_channels - self.partition_pad_size)
            if self.partition_pad_size:
                in_tensor = F.pad(in_tensor, (0, 0, 0, 0, 0, self.partition_pad_size))
            x = mappings.scatter_input_channels_to_tensor_model_parallel_region(in_tensor, group)
        y = mappings.reduce_from_tensor_model_parallel_region(self._conv(x, None), group)
        return y + self.bias[:, None, None] if self.bias is not None else y
