"""Tensor-parallel embedding: E split along the vocabulary (default) or the embedding dim.

Vocabulary sharding: rank i holds rows ``[i V/p, (i+1) V/p)`` of E; an id outside that range
looks up zeros here and the lookups are summed over TP. Embedding sharding
(``shard_across_embedding``): rank i holds columns ``[i D/p, (i+1) D/p)`` of every row and the
lookups are all-gathered along the last dim. Under sequence parallelism the output is
sequence-first ``[s/tp, b, h]`` (NxD's layout: the ``[b, s, h]`` lookup is transposed before the
reduce-scatter), or ``[b, s/tp, h]`` with ``sequence_dimension=1``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from nxd_layers import mappings
from nxd_layers._attributes import (
    ParallelModuleMixin,
    pick_tensor_parallel_group,
    set_tensor_model_parallel_attributes,
    tensor_parallel_rank_and_size,
)
from nxd_layers._init import InitMethod, init_master, is_meta, sharded_parameter
from nxd_layers._linear_common import check_reinitialisable, copy_local_slice
from nxd_layers.utils import get_padding_length
from nxd_state import collectives

__all__ = ["ParallelEmbedding"]

logger = logging.getLogger(__name__)

# torch.embedding_renorm_ divides by (norm + 1e-7); the sharded renorm does the same.
_RENORM_EPS = 1e-7


def _reference_layout(
    third: Any, fourth: Any, fifth: Any, init_method: Any, dtype: Any, device: Any
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """Resolve the third to fifth positional arguments to (padding_idx, max_norm, norm_type,
    init_method, dtype, device).

    NxD's code takes ``(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, ...)``
    while its API reference documents ``(num_embeddings, embedding_dim, init_method, dtype,
    device)``. A callable third argument selects the reference layout: the next two positions
    then hold ``dtype`` and ``device`` (told apart from ``max_norm`` / ``norm_type`` by type).
    """
    if not callable(third):
        return third, fourth, fifth, init_method, dtype, device
    if init_method is not nn.init.normal_:
        raise ValueError(
            "ParallelEmbedding: init_method given twice (third positional argument and "
            "init_method=)"
        )
    if fourth is not None and not isinstance(fourth, torch.dtype):
        raise ValueError(
            "ParallelEmbedding: with init_method as the third argument (the reference layout "
            f"num_embeddings, embedding_dim, init_method, dtype, device) the fourth must be a "
            f"torch.dtype, got {fourth!r}"
        )
    if isinstance(fourth, torch.dtype):
        if dtype is not torch.float32 and dtype != fourth:
            raise ValueError(f"ParallelEmbedding: dtype given twice ({fourth} and {dtype})")
        dtype = fourth
    if not isinstance(fifth, int | float) or isinstance(fifth, bool):
        if device is not None:
            raise ValueError(f"ParallelEmbedding: device given twice ({fifth!r} and {device!r})")
        device, fifth = fifth, 2.0
    return None, None, fifth, third, dtype, device


def _refuse_unsupported(collect_output: bool, use_spmd_rank: bool, sequence_dimension: int) -> None:
    """NxD arguments nxd does not implement: one clear error each, before any work."""
    if collect_output is not True:
        raise ValueError(
            f"ParallelEmbedding: collect_output={collect_output!r} is not supported; the "
            f"output is always collected (all-reduced, reduce-scattered under sequence "
            f"parallelism, or all-gathered with shard_across_embedding), as with "
            f"collect_output=True"
        )
    if use_spmd_rank:
        raise ValueError(
            "ParallelEmbedding: use_spmd_rank=True (an XLA SPMD inference-tracing aid) is "
            "not supported; ranks come from the process group"
        )
    if sequence_dimension not in (0, 1):
        raise ValueError(
            "ParallelEmbedding: sequence_dimension must be 0 (output [s/tp, b, h], NxD's) "
            f"or 1 (output [b, s/tp, h]), got {sequence_dimension!r}"
        )


class ParallelEmbedding(ParallelModuleMixin, nn.Module):
    """Y[t] = E[x_t] with E sharded over TP; ``torch.nn.Embedding``'s options kept.

    Vocabulary sharding: Y = sum_i Y_i, Y_i the lookups of ids in rank i's rows (zeros
    elsewhere), an all-reduce (or a reduce-scatter under sequence parallelism). Embedding
    sharding: Y = [Y_1 | ... | Y_p], an all-gather of each rank's columns. The master table is
    drawn from the seed on CPU in float32 (N(0, 1) by default, as ``nn.Embedding``) and sliced,
    so every TP degree holds the same table; the ``padding_idx`` row is zeroed and gets no
    gradient. ``max_norm`` renormalises looked-up rows as ``nn.Embedding`` does, with the
    norm of the whole row when its columns are sharded. ``pad`` appends zero rows (vocabulary
    sharding) or zero columns (embedding sharding) up to a multiple of the TP size; padded
    columns are dropped from the output. ``padding_idx`` is stored as an index into this
    rank's ``weight`` (None when the row lives elsewhere), as NxD does.

    ids are ``[b, s]`` (any shape without sequence parallelism). ``tensor_model_parallel_group``
    is NxD's name for ``tensor_parallel_group``; ``use_spmd_rank`` (an XLA SPMD tracing aid) is
    not supported. NxD's ``collect_output`` is accepted as True (the collected output above,
    what this layer always returns); False is refused.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | InitMethod | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = nn.init.normal_,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        shard_across_embedding: bool = False,
        pad: bool = False,
        sequence_parallel_enabled: bool = False,
        tensor_model_parallel_group: ProcessGroup | None = None,
        use_spmd_rank: bool = False,
        *,
        tensor_parallel_group: ProcessGroup | None = None,
        sequence_dimension: int = 0,
        collect_output: bool = True,
    ) -> None:
        super().__init__()
        _refuse_unsupported(collect_output, use_spmd_rank, sequence_dimension)
        pad_idx: int | None  # _validate below refuses anything else
        pad_idx, max_norm, norm_type, init_method, dtype, device = _reference_layout(
            padding_idx, max_norm, norm_type, init_method, dtype, device
        )
        _validate(num_embeddings, embedding_dim, pad_idx, max_norm, norm_type)
        self.tensor_parallel_group = pick_tensor_parallel_group(
            tensor_parallel_group, tensor_model_parallel_group, "ParallelEmbedding"
        )
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        self.tensor_model_parallel_size = tp
        self.shard_across_embedding = shard_across_embedding
        self.pad = pad
        self.max_norm, self.norm_type = max_norm, float(norm_type)
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.init_method, self.dtype = init_method, dtype
        self.stride = 1
        if pad_idx is not None and pad_idx < 0:
            pad_idx += num_embeddings  # as nn.Embedding
        self._global_padding_idx = pad_idx
        self._build_weight(num_embeddings, embedding_dim, pad_idx, rank, dtype, device)

    def _build_weight(
        self,
        num_embeddings: int,
        embedding_dim: int,
        pad_idx: int | None,
        rank: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        """The table: its sharded dimension padded (:meth:`_partition`), the full table drawn
        from the seed (not on the meta device), this rank's slice kept as ``weight``."""
        tp = self.tensor_model_parallel_size
        local_shape, sharded, what = self._partition(num_embeddings, embedding_dim, pad_idx, rank)
        self._unpadded_shape = (num_embeddings, embedding_dim)
        master = None
        if not is_meta(device):
            master = self._draw_table()
            if self.pad_size:
                logger.info("padded %s from %d to %d", what, sharded, sharded + self.pad_size)
        self.weight = sharded_parameter(
            master,
            local_shape,
            partition_dim=self.weight_partition_dim,
            rank=rank,
            world_size=tp,
            dtype=dtype,
            device=device,
        )
        set_tensor_model_parallel_attributes(self.weight, True, self.weight_partition_dim, 1)

    def _partition(
        self, num_embeddings: int, embedding_dim: int, pad_idx: int | None, rank: int
    ) -> tuple[tuple[int, int], int, str]:
        """Pad the sharded dimension to a multiple of TP (only with ``pad=True``), set NxD's
        size attributes and this rank's ``padding_idx``; returns the local weight's shape,
        the sharded dimension's size before padding and its name."""
        tp = self.tensor_model_parallel_size
        sharded = embedding_dim if self.shard_across_embedding else num_embeddings
        what = "embedding_dim" if self.shard_across_embedding else "num_embeddings"
        self.pad_size = get_padding_length(sharded, tp)
        if self.pad_size and not self.pad:
            raise ValueError(
                f"ParallelEmbedding: {what}({sharded}) is not divisible by "
                f"tensor_parallel_size({tp}); pad it to {sharded + self.pad_size} or pass pad=True"
            )
        self.original_size = sharded  # before padding (NxD keeps only the padded size)
        if self.shard_across_embedding:
            self.embedding_dim = embedding_dim + self.pad_size
            self.num_embeddings = num_embeddings
            self.num_embeddings_per_partition = num_embeddings
            self.embedding_dim_per_partition = self.embedding_dim // tp
            self.weight_partition_dim = 1
            self.padding_idx = pad_idx
            local_shape = (num_embeddings, self.embedding_dim_per_partition)
        else:
            self.num_embeddings = num_embeddings + self.pad_size
            self.embedding_dim = embedding_dim
            self.num_embeddings_per_partition = self.num_embeddings // tp
            self.embedding_dim_per_partition = embedding_dim
            self.weight_partition_dim = 0
            self.start_index = rank * self.num_embeddings_per_partition
            self.end_index = self.start_index + self.num_embeddings_per_partition
            self.padding_idx = None  # on the rank whose rows hold it, its local row
            if pad_idx is not None and self.start_index <= pad_idx < self.end_index:
                self.padding_idx = pad_idx - self.start_index
            local_shape = (self.num_embeddings_per_partition, embedding_dim)
        self.per_partition_size = local_shape[self.weight_partition_dim]
        return local_shape, sharded, what

    def _draw_table(self) -> torch.Tensor:
        """The full (padded) float32 table from the seed: ``init_method`` on the unpadded
        ``(num_embeddings, embedding_dim)`` table, the ``padding_idx`` row zeroed, zero rows or
        columns appended up to the padded size."""
        rows, cols = self._unpadded_shape
        table = init_master((rows, cols), self.init_method)
        if self._global_padding_idx is not None:
            table[self._global_padding_idx].zero_()
        master = torch.zeros(self.num_embeddings, self.embedding_dim)
        master[:rows, :cols] = table
        return master

    def init_weight_cpu(self) -> None:
        """E <- init_method(E) re-drawn (NxD's re-initialisation after meta-device building):
        the full table is drawn on CPU in float32 from the current seed exactly as the
        constructor draws it (the same values for the same seed, at any TP degree; the
        ``padding_idx`` row and padded rows/columns zero) and this rank's slice is copied into
        ``weight`` in place."""
        check_reinitialisable(self, "init_weight_cpu", self.weight)
        copy_local_slice(
            self, "init_weight_cpu", self.weight, self._draw_table(), self.weight_partition_dim
        )

    # Forward ---------------------------------------------------------------------------
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if input_.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ParallelEmbedding expects integer ids, got dtype {input_.dtype}")
        if self.sequence_parallel_enabled and input_.dim() != 2:
            raise ValueError(
                "ParallelEmbedding with sequence_parallel_enabled=True needs ids of shape "
                f"[batch, sequence], got shape {tuple(input_.shape)}"
            )
        if self.shard_across_embedding:
            return self._forward_shard_across_embed(input_)
        return self._forward_shard_across_vocab(input_)

    def _forward_shard_across_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        group = self.tensor_parallel_group
        outside = None
        if self.tensor_model_parallel_size > 1:
            outside = (ids < self.start_index) | (ids >= self.end_index)
            local_ids = (ids - self.start_index).masked_fill(outside, 0)
        else:
            local_ids = ids
        if self.max_norm is not None:
            looked_up = local_ids if outside is None else local_ids[~outside]
            self._renorm_rows(looked_up, reduce_over_tp=False)
        if self.scale_grad_by_freq and outside is not None:
            # Masked ids must not count as uses of row 0: route them to an extra zero row.
            table = torch.cat([self.weight, self.weight.new_zeros(1, self.embedding_dim)])
            partial = F.embedding(
                local_ids.masked_fill(outside, self.num_embeddings_per_partition),
                table,
                self.padding_idx,
                scale_grad_by_freq=True,
                sparse=self.sparse,
            )
        else:
            partial = F.embedding(
                local_ids,
                self.weight,
                self.padding_idx,
                scale_grad_by_freq=self.scale_grad_by_freq,
                sparse=self.sparse,
            )
            if outside is not None:
                partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if not self.sequence_parallel_enabled:
            return mappings.reduce_from_tensor_model_parallel_region(partial, group)
        if self.sequence_dimension == 0:  # [b, s, h] -> [s, b, h], scattered along s
            partial = partial.transpose(0, 1)
        return mappings.reduce_scatter_to_sequence_parallel_region(
            partial, self.sequence_dimension, process_group=group
        )

    def _forward_shard_across_embed(self, ids: torch.Tensor) -> torch.Tensor:
        group = self.tensor_parallel_group
        if self.max_norm is not None:
            self._renorm_rows(ids, reduce_over_tp=True)
        partial = F.embedding(
            ids,
            self.weight,
            self.padding_idx,
            scale_grad_by_freq=self.scale_grad_by_freq,
            sparse=self.sparse,
        )
        out = mappings.gather_from_tensor_model_parallel_region(partial, group)
        if self.pad_size:
            out = out.narrow(-1, 0, self.embedding_dim - self.pad_size)
        if not self.sequence_parallel_enabled:
            return out
        if self.sequence_dimension == 0:
            out = out.transpose(0, 1)
        return mappings.scatter_to_sequence_parallel_region(
            out, self.sequence_dimension, process_group=group
        )

    @torch.no_grad()
    def _renorm_rows(self, local_ids: torch.Tensor, reduce_over_tp: bool) -> None:
        """E[r] <- E[r] * max_norm / (||E[r]||_p + 1e-7) for looked-up rows with norm > max_norm
        (``torch.embedding_renorm_``), the norm over the whole row when columns are sharded."""
        rows = torch.unique(local_ids.reshape(-1))
        if not reduce_over_tp:
            torch.embedding_renorm_(self.weight, rows, self.max_norm, self.norm_type)
            return
        # Every rank looks up the same ids (inputs are replicated), so ``rows`` agree.
        part = self.weight[rows].float()
        p = self.norm_type
        if math.isinf(p):
            norms = part.abs().amax(dim=-1)
            collectives.all_reduce(norms, group=self.tensor_parallel_group, op=ReduceOp.MAX)
        else:
            norms = part.abs().pow(p).sum(dim=-1)
            collectives.all_reduce(norms, group=self.tensor_parallel_group)
            norms = norms.pow(1.0 / p)
        scale = torch.where(norms > self.max_norm, self.max_norm / (norms + _RENORM_EPS), 1.0)
        self.weight[rows] = (part * scale.unsqueeze(-1)).to(self.weight.dtype)

    # Checkpoints -------------------------------------------------------------------------
    def preshard_hook(self, model_state_dict: dict[str, torch.Tensor], prefix: str) -> None:
        """Zero-pad the full (unpadded) table at ``model_state_dict[prefix]`` to this layer's
        padded size along the sharded dim, before it is sliced (NxD's loading hook)."""
        if not self.pad or not self.pad_size:
            return
        dim = self.weight_partition_dim
        full = model_state_dict[prefix]
        if full.shape[dim] != self.original_size:
            raise ValueError(
                f"ParallelEmbedding.preshard_hook: {prefix} has size {full.shape[dim]} along dim "
                f"{dim}, expected the unpadded {self.original_size}"
            )
        pad = (0, self.pad_size) if dim == 1 else (0, 0, 0, self.pad_size)
        model_state_dict[prefix] = F.pad(full, pad)

    def extra_repr(self) -> str:
        sharding = "embedding_dim" if self.shard_across_embedding else "vocabulary"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, sharded along the {sharding} "
            f"(local {tuple(self.weight.shape)}), padding_idx={self._global_padding_idx}, "
            f"sequence_parallel_enabled={self.sequence_parallel_enabled}"
        )


def _validate(
    num_embeddings: Any, embedding_dim: Any, padding_idx: Any, max_norm: Any, norm_type: Any
) -> None:
    """Raise, naming the value, on arguments ``nn.Embedding`` would not accept."""
    for key, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"ParallelEmbedding: {key} must be a positive int, got {value!r}")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise ValueError(
                f"ParallelEmbedding: padding_idx must be an int or None, got {padding_idx!r}"
            )
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(
                f"ParallelEmbedding: padding_idx({padding_idx}) must be in "
                f"[-num_embeddings, num_embeddings({num_embeddings}))"
            )
    if max_norm is not None and (not isinstance(max_norm, int | float) or max_norm <= 0):
        raise ValueError(f"ParallelEmbedding: max_norm must be a positive number, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or norm_type <= 0:
        raise ValueError(
            f"ParallelEmbedding: norm_type must be a positive number, got {norm_type!r}"
        )
