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

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from nxd_layers import mappings
from nxd_layers._attributes import (
    pick_tensor_parallel_group,
    set_tensor_model_parallel_attributes,
    tensor_parallel_rank_and_size,
)
from nxd_layers._init import InitMethod, init_master, is_meta, sharded_parameter
from nxd_layers._linear_common import check_input, check_reduce_dtype
from nxd_layers.linear import BaseParallelLinear
from nxd_state import collectives

__all__ = [
    "GQAQKVColumnParallelLinear",
    "get_kv_size_multiplier",
    "gqa_kv_replica_rows",
    "neuronx_gqa_rank_map",
]


def get_kv_size_multiplier(num_key_value_heads: int, tensor_parallel_size: int) -> int:
    """Smallest m >= 1 with (num_key_value_heads * m) divisible by tensor_parallel_size."""
    if num_key_value_heads <= 0 or tensor_parallel_size <= 0:
        raise ValueError(
            f"num_key_value_heads({num_key_value_heads}) and "
            f"tensor_parallel_size({tensor_parallel_size}) must be positive"
        )
    return tensor_parallel_size // math.gcd(num_key_value_heads, tensor_parallel_size)


def gqa_kv_replica_rows(num_kv_heads: int, head_dim: int, kv_size_multiplier: int) -> list[int]:
    """Entry i: the row of the unreplicated K (or V) projection that row i of the replicated
    one copies, in this layout's head-by-head order.

    With n = ``num_kv_heads``, d = ``head_dim`` and m = ``kv_size_multiplier``, the
    replicated projection has n·m·d rows: heads ``[k_0] * m + [k_1] * m + ...``, so row
    ``(h·m + c)·d + j`` (head h, copy c < m, row j < d of the head) is row ``h·d + j``. Rank r
    of t holds rows ``[r·n·m·d/t, (r+1)·n·m·d/t)`` of it (checkpoints map them back with
    this list; the first copy of each row is its primary).
    """
    if min(num_kv_heads, head_dim, kv_size_multiplier) <= 0:
        raise ValueError(
            f"num_kv_heads({num_kv_heads}), head_dim({head_dim}) and "
            f"kv_size_multiplier({kv_size_multiplier}) must be positive"
        )
    return [
        head * head_dim + row
        for head in range(num_kv_heads)
        for _ in range(kv_size_multiplier)
        for row in range(head_dim)
    ]


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
        self.kv_heads, self.head_dim = _kv_layout(q_size, kv_size, tp, kv_size_multiplier, head_dim)
        self.input_size, self.output_sizes = input_size, [q_size, kv_size]
        self.kv_size_multiplier = kv_size_multiplier
        self.q_output_size_per_partition = q_size // tp
        self.kv_output_size_per_partition = kv_size * kv_size_multiplier // tp
        self.gather_output, self.fuse_qkv = gather_output, fuse_qkv
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = sequence_dimension
        self.tensor_parallel_size = tp

        meta = is_meta(device)
        self.arg_init_method = init_method
        bound = 1.0 / math.sqrt(input_size)
        masters: dict[str, torch.Tensor | None] = {}
        for part, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            masters[f"weight_{part}"] = (
                None if meta else init_master((size, input_size), self._init_weight)
            )
        for part, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            if bias:
                masters[f"bias_{part}"] = (
                    None
                    if meta
                    else init_master((size,), lambda b: nn.init.uniform_(b, -bound, bound))
                )
        self._keep_masters(masters if keep_master_weight else {}, fuse_qkv)
        local: dict[str, nn.Parameter] = {}
        for name, master in masters.items():
            replicated = not name.endswith("_q")
            if master is not None and replicated:
                master = self._replicate(master)
            rows = self.kv_output_size_per_partition if replicated else q_size // tp
            shape = (rows, input_size) if name.startswith("weight") else (rows,)
            local[name] = sharded_parameter(
                master, shape, partition_dim=0, rank=rank, world_size=tp, dtype=dtype, device=device
            )
        replicas = 1 if self.kv_size_multiplier == 1 else self.kv_size_multiplier
        for kind in ("weight", "bias") if bias else ("weight",):
            parts = [local[f"{kind}_{p}"] for p in "qkv"]
            if fuse_qkv:
                fused = nn.Parameter(torch.cat([p.data for p in parts]))
                set_tensor_model_parallel_attributes(fused, True, 0, 1)
                if replicas > 1:  # per-row copy counts: Q rows once, K/V rows m times
                    counts = [1] * parts[0].shape[0] + [replicas] * 2 * parts[1].shape[0]
                    fused.tensor_parallel_replicas = torch.tensor(counts, dtype=torch.float32)
                self.register_parameter(f"{kind}_qkv", fused)
                continue
            for part, param in zip("qkv", parts):
                set_tensor_model_parallel_attributes(param, True, 0, 1)
                if part != "q" and replicas > 1:
                    param.tensor_parallel_replicas = replicas
                self.register_parameter(f"{kind}_{part}", param)
        if not bias:
            for name in ("bias_qkv",) if fuse_qkv else ("bias_q", "bias_k", "bias_v"):
                self.register_parameter(name, None)

    def _keep_masters(self, masters: dict[str, torch.Tensor | None], fused: bool) -> None:
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
            if i > 0:
                weight, bias = self._tie_replicas(weight), self._tie_replicas(bias)
            outputs.append(F.linear(x, weight, bias))
        q, k, v = outputs
        if self.gather_output:
            q = mappings.gather_from_tensor_model_parallel_region(q, group)
            k = self._dereplicate(mappings.gather_from_tensor_model_parallel_region(k, group))
            v = self._dereplicate(mappings.gather_from_tensor_model_parallel_region(v, group))
        return q, k, v


def _kv_layout(
    q_size: int, kv_size: int, tp: int, multiplier: int, head_dim: int | None
) -> tuple[int, int]:
    """(number of KV heads, head_dim), after checking every size against the TP degree."""
    if not isinstance(multiplier, int) or multiplier < 1:
        raise ValueError(f"kv_size_multiplier must be an int >= 1, got {multiplier!r}")
    if q_size % tp != 0:
        raise ValueError(
            f"q_size({q_size}) is not divisible by tensor_parallel_size({tp}): the attention "
            f"heads must divide evenly over TP; pad them with nxd_layers.pad_model"
        )
    if head_dim is None:
        if multiplier == 1:
            if kv_size % tp != 0:
                raise ValueError(
                    f"kv_size({kv_size}) is not divisible by tensor_parallel_size({tp}): pass "
                    f"kv_size_multiplier=get_kv_size_multiplier(num_kv_heads, {tp}) and head_dim"
                )
            return 1, kv_size  # no replication: head boundaries do not matter
        if tp % multiplier != 0 or kv_size % (tp // multiplier) != 0:
            raise ValueError(
                f"kv_size_multiplier({multiplier}) without head_dim assumes one KV head per rank "
                f"(tensor_parallel_size({tp}) / kv_size_multiplier KV heads dividing "
                f"kv_size({kv_size})); pass head_dim to use another multiplier"
            )
        return tp // multiplier, kv_size * multiplier // tp
    if head_dim <= 0 or q_size % head_dim or kv_size % head_dim:
        raise ValueError(
            f"head_dim({head_dim}) must divide q_size({q_size}) and kv_size({kv_size})"
        )
    heads, kv_heads = q_size // head_dim, kv_size // head_dim
    if heads % kv_heads != 0:
        raise ValueError(f"num_heads({heads}) is not a multiple of num_kv_heads({kv_heads})")
    if heads % tp != 0:
        raise ValueError(
            f"num_heads({heads}) is not divisible by tensor_parallel_size({tp}); pad the heads "
            f"with nxd_layers.pad_model"
        )
    if heads % (kv_heads * multiplier) != 0:
        raise ValueError(
            f"num_kv_heads({kv_heads}) x kv_size_multiplier({multiplier}) = "
            f"{kv_heads * multiplier} KV heads after replication do not divide "
            f"num_heads({heads}); use a smaller multiplier"
        )
    if (kv_heads * multiplier) % tp != 0:
        raise ValueError(
            f"num_kv_heads({kv_heads}) x kv_size_multiplier({multiplier}) = "
            f"{kv_heads * multiplier} is not divisible by tensor_parallel_size({tp}); the "
            f"smallest valid multiplier is {get_kv_size_multiplier(kv_heads, tp)}"
        )
    return kv_heads, head_dim


def neuronx_gqa_rank_map(
    num_heads: int, num_kv_heads: int, tensor_parallel_size: int, kv_size_multiplier: int
) -> list[int]:
    """Entry r: the TP rank of this layout holding what NxD's GQA checkpoints hold on rank r.

    NxD replicates K/V block-wise (``W_k.repeat(m, 1)``, so rank r holds KV head
    ``r % num_kv_heads``) and, in its checkpoint converter, regroups the Q heads (and the
    o_proj columns) so that rank r's Q heads are those attending to that head: Q head group
    ``(r % n_kv) * (tp / n_kv) + r // n_kv`` of ``tp`` equal groups. Here rank s holds Q group
    s and KV head ``s // m`` (standard grouping), so NxD's rank r equals this layout's rank
    ``(r % n_kv) * (tp / n_kv) + r // n_kv`` for every attention tensor (Q, K, V and o_proj's
    input columns); the MLP, embedding and norms are not permuted. Defined, as NxD's converter
    is, for one KV head per rank (``num_kv_heads * kv_size_multiplier == tensor_parallel_size``);
    without replication (multiplier 1) both layouts are the identity.
    """
    tp, n_kv, m = tensor_parallel_size, num_kv_heads, kv_size_multiplier
    if min(num_heads, n_kv, tp, m) <= 0 or num_heads % tp or num_heads % n_kv:
        raise ValueError(
            f"num_heads({num_heads}) must be divisible by tensor_parallel_size({tp}) and "
            f"num_kv_heads({n_kv}), all positive"
        )
    if m == 1:
        return list(range(tp))
    if n_kv * m != tp:
        raise ValueError(
            f"NxD's GQA layout with kv_size_multiplier({m}) > 1 holds one KV head per rank: "
            f"num_kv_heads({n_kv}) x kv_size_multiplier({m}) must equal "
            f"tensor_parallel_size({tp})"
        )
    return [(r % n_kv) * (tp // n_kv) + r // n_kv for r in range(tp)]
