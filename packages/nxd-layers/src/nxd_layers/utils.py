"""NxD's small ``parallel_layers.utils`` helpers: splits, padding arithmetic, vocab ranges, casts.

Pure tensor and integer helpers (no collectives, nothing device-specific), with NxD's names
and signatures, so NxD model code that imports them keeps working. The sharding attributes
and ``divide`` live in :mod:`nxd_layers._attributes` (re-exported from the package).
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_layers._attributes import divide

__all__ = [
    "EmbeddingUtility",
    "cast_all",
    "cast_tensor",
    "get_padding_length",
    "is_torch_version_greater_than_2",
    "split_tensor_along_dim",
    "split_tensor_along_last_dim",
    "split_tensor_along_second_dim",
]


class EmbeddingUtility:
    """[first, last) of the vocabulary rows held by ``rank`` when V is split into equal parts."""

    @staticmethod
    def range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """first = rank * V_p, last = first + V_p."""
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """As above with V_p = V / world_size (which must be exact)."""
        per_partition = divide(global_vocab_size, world_size)
        return EmbeddingUtility.range_from_per_partition_vocab_size(per_partition, rank, world_size)


def split_tensor_along_dim(
    tensor: torch.Tensor, dim: int, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """T = [T_0, ..., T_{n-1}] along ``dim``, n = ``num_partitions`` equal parts (views unless
    ``contiguous_split_chunks``)."""
    size = divide(tensor.shape[dim], num_partitions)
    chunks = torch.split(tensor, size, dim=dim)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """:func:`split_tensor_along_dim` on the last dimension."""
    return split_tensor_along_dim(tensor, tensor.dim() - 1, num_partitions, contiguous_split_chunks)


def split_tensor_along_second_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """:func:`split_tensor_along_dim` on dimension 1."""
    return split_tensor_along_dim(tensor, 1, num_partitions, contiguous_split_chunks)


def get_padding_length(numerator: int, denominator: int) -> int:
    """p >= 0, the smallest with (numerator + p) divisible by ``denominator``."""
    if denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    return -numerator % denominator


def is_torch_version_greater_than_2() -> bool:
    """True on torch 2.x and later (NxD's name; it gates float8 and pjrt paths)."""
    return int(torch.__version__.split(".")[0]) >= 2


def cast_tensor(
    tensor: torch.Tensor,
    from_dtype: torch.dtype = torch.float32,
    to_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``tensor`` in ``to_dtype`` if it is ``from_dtype``, else unchanged."""
    return tensor.to(dtype=to_dtype) if tensor.dtype == from_dtype else tensor


def cast_all(
    state: Any, from_dtype: torch.dtype = torch.float32, to_dtype: torch.dtype = torch.bfloat16
) -> Any:
    """:func:`cast_tensor` on every tensor of a nest of dicts, lists and tuples; other leaves
    are returned as they are."""
    if isinstance(state, torch.Tensor):
        return cast_tensor(state, from_dtype, to_dtype)
    if isinstance(state, dict):
        return {key: cast_all(value, from_dtype, to_dtype) for key, value in state.items()}
    if isinstance(state, list | tuple):
        values = [cast_all(value, from_dtype, to_dtype) for value in state]
        return type(state)(*values) if hasattr(state, "_fields") else type(state)(values)
    return state
