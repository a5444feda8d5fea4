"""GQA QKV projection, column-parallel, with K/V heads replicated when TP exceeds them.

Q = X W_q^T + b_q, K = X W_k^T + b_k, V = X W_v^T + b_v, each split along its output features
(heads). Under grouped-query attention K/V have fewer heads than Q; when the TP size does not
divide the number of KV heads, each KV head is replicated ``kv_size_multiplier`` times (head
by head: ``[k_0, k_0, k_1, k_1]`` for 2 heads and multiplier 2) so that every rank holds
whole KV heads, namely the ones its Q heads attend to. The replicas of one head must stay
equal: their gradients are summed in backward and every replica receives the sum, which is
the unsharded model's gradient for that head.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import nxd_state
from nxd_layers import mappings
from nxd_layers._attributes import (
    pick_tensor_parallel_group,
    set_tensor_model_parallel_attributes,
    shard_for_rank,
    tensor_parallel_rank_and_size,
)
from nxd_layers._gqa_layout import (
    get_kv_size_multiplier,
    gqa_kv_replica_rows,
    kv_layout,
    neuronx_gqa_rank_map,
)
from nxd_layers._init import InitMethod, init_master, is_meta, sharded_parameter
from nxd_layers._linear_common import (
    bias_init,
    check_input,
    check_reduce_dtype,
    check_reinitialisable,
    copy_local_slice,
)
from nxd_layers.linear import BaseParallelLinear
from nxd_state import collectives

__all__ = [
    "GQAQKVColumnParallelLinear",
    "get_kv_size_multiplier",
    "gqa_kv_replica_rows",
    "neuronx_gqa_rank_map",
]

logger = logging.getLogger(__name__)


class _SumReplicaGrads(torch.autograd.Function):
    """Y = W (a replicated K/V shard); dL/dW_replica = sum over the replicas of the head."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: ProcessGroup, heads: int, mult: int) -> Any:
        ctx.group, ctx.heads, ctx.mult = group, heads, mult
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        full = collectives.all_gather(grad.contiguous(), group=ctx.group, dim=0)
        per_head = full.reshape(ctx.heads, ctx.mult, -1).sum(dim=1, keepdim=True)
        combined = per_head.expand(ctx.heads, ctx.mult, per_head.shape[-1]).reshape(full.shape)
        rank, n = collectives.group_rank(ctx.group), collectives.group_size(ctx.group)
        return combined.chunk(n, dim=0)[rank].contiguous(), None, None, None


class GQAQKVColumnParallelLinear(BaseParallelLinear):
    """(Q, K, V) = (X W_q^T + b_q, X W_k^T + b_k, X W_v^T + b_v), heads split over TP.

    ``output_sizes = [q_size, kv_size]`` (``num_heads * head_dim``, ``num_kv_heads *
    head_dim``). Each rank holds ``q_size / tp`` rows of W_q and ``kv_size * m / tp`` rows of
    the head-replicated W_k, W_v (``m = kv_size_multiplier``). ``head_dim`` tells the head
    boundaries; without it and with ``m > 1`` every rank is assumed to hold exactly one KV
    head (``num_kv_heads * m == tp``, what :func:`get_kv_size_multiplier` picks when TP is a
    multiple of the KV heads). ``gather_output`` returns the unsharded Q, K, V (K and V
    de-replicated, as ``nn.Linear(input_size, kv_size)`` would give). ``fuse_qkv`` stores one
    ``weight_qkv`` (rows: local Q, K, V) instead of ``weight_q/k/v``.

    ``keep_master_weight`` keeps, as NxD does, the full unreplicated float32 master weights
    ``master_weight_q`` ``(q_size, in)``, ``master_weight_k`` / ``master_weight_v``
    ``(kv_size, in)`` (and ``master_bias_q/k/v``); with ``fuse_qkv`` they are concatenated
    into ``master_weight_qkv`` (``master_bias_qkv``) and the separate ones are None.
    NxD replicates KV heads block-wise (``[k0, k1, k0, k1]``) and reorders Q heads in its
    checkpoints; :func:`neuronx_gqa_rank_map` maps its TP ranks to this layout's.
    ``reduce_dtype`` (NxD's): the backward all-reduce (reduce-scatter under SP) of the input
    gradient happens in this dtype. ``tensor_model_parallel_group`` is NxD's name for
    ``tensor_parallel_group``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int] | tuple[int, int],
        bias: bool = True,
        gather_output: bool = True,
        sequence_parallel_enabled: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        kv_size_multiplier: int = 1,
        fuse_qkv: bool = False,
        tensor_parallel_group: ProcessGroup | None = None,
        *,
        head_dim: int | None = None,
        sequence_dimension: int = 0,
        keep_master_weight: bool = False,
        tensor_model_parallel_group: ProcessGroup | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.reduce_dtype = check_reduce_dtype(type(self).__name__, reduce_dtype)
        if not isinstance(input_size, int) or input_size <= 0:
            raise ValueError(f"input_size must be a positive int, got {input_size!r}")
        if len(output_sizes) != 2 or min(output_sizes) <= 0:
            raise ValueError(f"output_sizes must be [q_size, kv_size] > 0, got {output_sizes!r}")
        q_size, kv_size = int(output_sizes[0]), int(output_sizes[1])
        self.tensor_parallel_group = pick_tensor_parallel_group(
            tensor_parallel_group, tensor_model_parallel_group, type(self).__name__
        )
        rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
        self.kv_heads, self.head_dim = kv_layout(q_size, kv_size, tp, kv_size_multiplier, head_dim)
        self.input_size, self.output_sizes = input_size, [q_size, kv_size]
        self.kv_size_multiplier = kv_size_multiplier
        self.q_output_size_per_partition = q_size // tp
        self.kv_output_size_per_partition = kv_size * kv_size_multiplier // tp
        self.gather_output, self.fuse_qkv = gather_output, fuse_qkv
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.tensor_parallel_size = tp
        self._ensure_kv_shared_groups()

        self.arg_init_method = init_method
        self.keep_master_weight = keep_master_weight
        masters = {} if is_meta(device) else self._draw_masters(bias)
        self._keep_masters(masters if keep_master_weight else {}, fuse_qkv)
        local = self._local_parameters(masters, bias, rank, dtype, device)
        for kind in ("weight", "bias") if bias else ("weight",):
            self._register(kind, [local[f"{kind}_{p}"] for p in "qkv"])
        if not bias:
            for name in ("bias_qkv",) if fuse_qkv else ("bias_q", "bias_k", "bias_v"):
                self.register_parameter(name, None)

    def _local_parameters(
        self,
        masters: dict[str, torch.Tensor],
        bias: bool,
        rank: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> dict[str, nn.Parameter]:
        """This rank's rows of each Q, K, V weight (and bias): K/V heads replicated
        ``kv_size_multiplier`` times before the split (uninitialised on the meta device)."""
        tp = self.tensor_parallel_size
        local: dict[str, nn.Parameter] = {}
        for kind in ("weight", "bias") if bias else ("weight",):
            for part in "qkv":
                q = part == "q"
                rows = self.q_output_size_per_partition if q else self.kv_output_size_per_partition
                master = masters.get(f"{kind}_{part}")
                if master is not None and not q:
                    master = self._replicate(master)
                shape = (rows, self.input_size) if kind == "weight" else (rows,)
                local[f"{kind}_{part}"] = sharded_parameter(
                    master, shape, partition_dim=0, rank=rank, world_size=tp, dtype=dtype,
                    device=device,
                )  # fmt: skip
        return local

    def _register(self, kind: str, parts: list[nn.Parameter]) -> None:
        """Register ``<kind>_q/k/v``, or their concatenation ``<kind>_qkv`` with
        ``fuse_qkv``, with the sharding attributes (K/V rows marked with their replica count)."""
        replicas = self.kv_size_multiplier
        if self.fuse_qkv:
            fused = nn.Parameter(torch.cat([p.data for p in parts]))
            set_tensor_model_parallel_attributes(fused, True, 0, 1)
            if replicas > 1:  # per-row copy counts: Q rows once, K/V rows m times
                counts = [1] * parts[0].shape[0] + [replicas] * 2 * parts[1].shape[0]
                # a sharding attribute on the parameter (torch's stubs do not know it)
                fused.tensor_parallel_replicas = torch.tensor(  # type: ignore[attr-defined]
                    counts, dtype=torch.float32
                )
            self.register_parameter(f"{kind}_qkv", fused)
            return
        for part, param in zip("qkv", parts):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
            if part != "q" and replicas > 1:
                param.tensor_parallel_replicas = replicas  # type: ignore[attr-defined]
            self.register_parameter(f"{kind}_{part}", param)

    def _ensure_kv_shared_groups(self) -> None:
        """NxD's GQA layer builds the KV-shared groups for its ``kv_size_multiplier`` m > 1
        (``initialize_kv_group(m)``); this one builds nxd's: m adjacent TP ranks
        (``sequential_ranks_in_group=True``), the ranks holding replicas of the same KV head
        when each rank holds one (``num_kv_heads * m == tp``; NxD's block-wise replication has
        interleaved groups instead, see :func:`neuronx_gqa_rank_map`).

        Nothing is built when m is 1, when the layer runs on a group other than the current
        state's TP group, or when m does not divide the TP size (NxD refuses such a layer;
        this one does not need the groups: it sums the replicas' gradients over its TP
        group). Groups already built (by the user, or by a layer with another m: NxD refuses
        mixed multipliers) are kept, with a warning when they differ from this layer's.
        """
        m, tp = self.kv_size_multiplier, self.tensor_parallel_size
        if m == 1 or tp % m or not nxd_state.model_parallel_is_initialized():
            return
        state = nxd_state.get_parallel_state()
        if self.tensor_parallel_group is not state.tensor_parallel_group:
            return
        built = state.kv_shared
        if built is None:
            state.initialize_kv_groups(m, sequential_ranks_in_group=True)
        elif (built.size, built.sequential_ranks_in_group) != (m, True):
            logger.warning(
                "GQAQKVColumnParallelLinear(kv_size_multiplier=%d): keeping the KV-shared groups "
                "already built (kv_shared_group_size=%d, sequential_ranks_in_group=%s); this "
                "layer's replicas of a KV head are on %d adjacent ranks",
                m,
                built.size,
                built.sequential_ranks_in_group,
                m,
            )

    def _draw_masters(self, bias: bool) -> dict[str, torch.Tensor]:
        """The full, unreplicated float32 masters, drawn on CPU from the seed in this order:
        W_q, W_k, W_v (``init_method``, else ``torch.nn.Linear``'s default), then with
        ``bias`` b_q, b_k, b_v ~ U(-1/sqrt(in), 1/sqrt(in))."""
        q_size, kv_size = self.output_sizes
        sizes = (("q", q_size), ("k", kv_size), ("v", kv_size))
        masters = {
            f"weight_{part}": init_master((size, self.input_size), self._init_weight)
            for part, size in sizes
        }
        if bias:
            draw = bias_init(self.input_size)
            masters.update({f"bias_{part}": init_master((size,), draw) for part, size in sizes})
        return masters

    def initialize_weight_biases(self) -> None:
        """NxD's re-initialisation (after meta-device building): W_q, W_k, W_v and, with a
        bias, b_q, b_k, b_v re-drawn on CPU from the current seed exactly as the constructor
        draws them (the same values for the same seed, at any TP degree), K/V replicated as
        the layer holds them, this rank's rows copied into the parameters in place (``weight_qkv``
        / ``bias_qkv`` when fused); the ``master_*`` tensors are refreshed with
        ``keep_master_weight``."""
        fused = self.fuse_qkv
        has_bias = (self.bias_qkv if fused else self.bias_q) is not None
        check_reinitialisable(self, "initialize_weight_biases", *self.parameters(recurse=False))
        masters = self._draw_masters(has_bias)
        for kind in ("weight", "bias") if has_bias else ("weight",):
            full = [masters[f"{kind}_q"]]
            full += [self._replicate(masters[f"{kind}_{part}"]) for part in "kv"]
            if fused:  # this rank's Q, K, V rows, one after another
                rank, tp = tensor_parallel_rank_and_size(self.tensor_parallel_group)
                rows = torch.cat([shard_for_rank(f, 0, rank, tp) for f in full])
                param = getattr(self, f"{kind}_qkv")
                copy_local_slice(self, "initialize_weight_biases", param, rows, None)
                continue
            for part, tensor in zip("qkv", full):
                param = getattr(self, f"{kind}_{part}")
                copy_local_slice(self, "initialize_weight_biases", param, tensor, 0)
        self._keep_masters(masters if self.keep_master_weight else {}, fused)

    def _keep_masters(self, masters: Mapping[str, torch.Tensor | None], fused: bool) -> None:
        """NxD's ``master_weight_q/k/v`` and ``master_bias_q/k/v``, or the ``*_qkv`` concat
        (the others None)."""
        for kind in ("weight", "bias"):
            parts = [masters.get(f"{kind}_{p}") for p in "qkv"]
            whole = None
            if fused:
                whole = None if parts[0] is None else torch.cat(parts)  # type: ignore[arg-type]
                parts = [None, None, None]
            setattr(self, f"master_{kind}_qkv", whole)
            for part, value in zip("qkv", parts):
                setattr(self, f"master_{kind}_{part}", value)

    def kv_replica_rows(self) -> list[int]:
        """For each row of the replicated K (or V) projection (``kv_size ·
        kv_size_multiplier`` rows, rank r holding the r-th of ``tp`` equal blocks), its row in
        the unreplicated ``(kv_size, input_size)`` projection (:func:`gqa_kv_replica_rows`)."""
        return gqa_kv_replica_rows(self.kv_heads, self.head_dim, self.kv_size_multiplier)

    def _replicate(self, master: torch.Tensor) -> torch.Tensor:
        """The replicated K/V master: rows picked by :meth:`kv_replica_rows`."""
        return master[torch.tensor(self.kv_replica_rows(), device=master.device)]

    def _parts(self, kind: str) -> tuple[torch.Tensor | None, ...]:
        if self.fuse_qkv:
            fused = getattr(self, f"{kind}_qkv")
            if fused is None:
                return None, None, None
            q_rows, kv_rows = self.q_output_size_per_partition, self.kv_output_size_per_partition
            return tuple(fused.split([q_rows, kv_rows, kv_rows], dim=0))
        return getattr(self, f"{kind}_q"), getattr(self, f"{kind}_k"), getattr(self, f"{kind}_v")

    @overload
    def _tie_replicas(self, tensor: torch.Tensor) -> torch.Tensor: ...
    @overload
    def _tie_replicas(self, tensor: None) -> None: ...
    def _tie_replicas(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or self.kv_size_multiplier == 1:
            return tensor
        return _SumReplicaGrads.apply(
            tensor, self.tensor_parallel_group, self.kv_heads, self.kv_size_multiplier
        )

    def _dereplicate(self, y: torch.Tensor) -> torch.Tensor:
        """(..., kv_heads * m * head_dim) -> (..., kv_heads * head_dim): the first replicas."""
        if self.kv_size_multiplier == 1:
            return y
        heads = y.reshape(*y.shape[:-1], self.kv_heads, self.kv_size_multiplier, self.head_dim)
        return heads[..., 0, :].reshape(*y.shape[:-1], self.kv_heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        weights, biases = self._parts("weight"), self._parts("bias")
        outputs = []
        for i, (weight, bias) in enumerate(zip(weights, biases)):
            assert weight is not None  # the layer always has weights; only biases may be None
            if i > 0:
                weight, bias = self._tie_replicas(weight), self._tie_replicas(bias)
            outputs.append(F.linear(x, weight, bias))
        q, k, v = outputs
        if self.gather_output:
            q = mappings.gather_from_tensor_model_parallel_region(q, group)
            k = self._dereplicate(mappings.gather_from_tensor_model_parallel_region(k, group))
            v = self._dereplicate(mappings.gather_from_tensor_model_parallel_region(v, group))
        return q, k, v
