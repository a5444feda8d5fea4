"""Vocabulary-parallel embedding: E split along the vocabulary, lookups summed over TP."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from nxd_layers import mappings
from nxd_layers._attributes import (
    ParallelModuleMixin,
    resolve_tensor_parallel_group,
    set_tensor_model_parallel_attributes,
    tensor_parallel_rank_and_size,
)
from nxd_layers._init import InitMethod, init_master, is_meta, sharded_parameter

__all__ = ["ParallelEmbedding"]

logger = logging.getLogger(__name__)


class ParallelEmbedding(ParallelModuleMixin, nn.Module):
    """Y[t] = E[x_t], E split along the vocabulary: E = [E_1; ...; E_p], Y = sum_i Y_i.

    Rank i holds rows ``[i V/p, (i+1) V/p)`` of E; an id outside that range looks up zeros
    here, so the sum over TP (an all-reduce, or a reduce-scatter along ``sequence_dimension``
    under sequence parallelism) gives every rank the full lookup. The master table is drawn
    from the seed and sliced (N(0, 1) by default, as ``torch.nn.Embedding``), with the
    ``padding_idx`` row zeroed and kept out of the gradient. A vocabulary not divisible by the
    TP size is an error unless ``pad=True``, which appends zero rows up to the next multiple
    (ids must still be below ``num_embeddings``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_method: InitMethod = nn.init.normal_,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        padding_idx: int | None = None,
        sequence_parallel_enabled: bool = False,
        tensor_parallel_group: ProcessGroup | None = None,
        *,
        sequence_dimension: int = 0,
        pad: bool = False,
    ) -> None:
        super().__init__()
        for key, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ParallelEmbedding: {key} must be a positive int, got {value!r}")
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(
                f"ParallelEmbedding: padding_idx({padding_idx}) must be in "
                f"[0, num_embeddings({num_embeddings}))"
            )
        self.tensor_parallel_group = resolve_tensor_parallel_group(tensor_parallel_group)
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        padded = -(-num_embeddings // tp) * tp
        if padded != num_embeddings and not pad:
            raise ValueError(
                f"ParallelEmbedding: num_embeddings({num_embeddings}) is not divisible by "
                f"tensor_parallel_size({tp}); pad the vocabulary to {padded} or pass pad=True"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_padded = padded
        self.num_embeddings_per_partition = padded // tp
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.padding_idx = padding_idx
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.tensor_parallel_size = tp

        master = None
        if not is_meta(device):
            table = init_master((num_embeddings, embedding_dim), init_method)
            if padding_idx is not None:
                table[padding_idx].zero_()
            master = torch.zeros(padded, embedding_dim)
            master[:num_embeddings] = table
            if padded != num_embeddings:
                logger.info("padded the vocabulary from %d to %d rows", num_embeddings, padded)
        self.weight = sharded_parameter(
            master,
            (self.num_embeddings_per_partition, embedding_dim),
            partition_dim=0,
            rank=rank,
            world_size=tp,
            dtype=dtype,
            device=device,
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    @property
    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is None:
            return None
        if self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            return self.padding_idx - self.vocab_start_index
        return None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ParallelEmbedding expects integer ids, got dtype {ids.dtype}")
        if self.sequence_parallel_enabled and ids.dim() != 2:
            raise ValueError(
                "ParallelEmbedding with sequence_parallel_enabled=True needs 2-D ids "
                f"(sequence dim {self.sequence_dimension}), got shape {tuple(ids.shape)}"
            )
        group = self.tensor_parallel_group
        if self.tensor_parallel_size > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        else:
            outside, local_ids = None, ids
        partial = F.embedding(local_ids, self.weight, self._local_padding_idx)
        if outside is not None:
            partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel_enabled:
            return mappings.reduce_scatter_to_sequence_parallel_region(
                partial, group, self.sequence_dimension
            )
        return mappings.reduce_from_tensor_model_parallel_region(partial, group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} "
            f"(per partition {self.num_embeddings_per_partition}), "
            f"sequence_parallel_enabled={self.sequence_parallel_enabled}"
        )
