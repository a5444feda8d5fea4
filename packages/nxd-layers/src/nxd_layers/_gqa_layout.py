"""GQA head arithmetic: KV multipliers, the head-by-head replica rows, NxD's rank map.

With n KV heads, head size d and ``kv_size_multiplier`` m, the replicated K (or V)
projection has n·m·d rows, heads ``[k_0] * m + [k_1] * m + ...``, split into tp equal
blocks over the TP ranks. Everything here is integer arithmetic: no tensors, no
communication.
"""

from __future__ import annotations

import math

__all__ = [
    "get_kv_size_multiplier",
    "gqa_kv_replica_rows",
    "kv_layout",
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


def kv_layout(
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
