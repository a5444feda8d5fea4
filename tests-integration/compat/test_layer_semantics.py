"""NxD's semantics of the parallel layers, through NxD's import paths, on 4 gloo ranks (TP=4).

One spawn runs every check (``run_named_checks`` names a failing one); the facts that nxd does
not yet share with NxD come back to the parent and are pinned as strict xfails there, so each
turns into a failure the day it is fixed.

* ``ColumnParallelLinear(gather_output=True)`` keeps NxD's full, replicated bias ``(out,)``
  (state dict ``weight (out/tp, in)``, ``bias (out,)``); ``gather_output=False`` shards it.
* ``ParallelEmbedding(num, dim, padding_idx)``: the padding index third and positional (NxD's
  Llama), a callable there is ``init_method`` (NxD's reference page); under sequence
  parallelism the output is sequence-first ``[s/tp, b, h]``.
* ``pad_model``: NxD zero-pads each rank's own shard (rows of Column, columns of Row).
* ``GQAQKVColumnParallelLinear(keep_master_weight=True)``: ``master_weight_q/k/v`` are the full,
  unreplicated weights the shards come from (``master_weight_qkv`` when fused); with
  ``kv_size_multiplier`` 2 the layer builds the KV-shared groups (nxd's adjacent order).
* NxD's ``init_weights(module)`` after a meta-device build (``init_weight_cpu()`` on
  Column/Row/ParallelEmbedding, biases zeroed, ``initialize_weight_biases()`` on GQA) gives
  the model built eagerly under the same seed, and ``init_method`` reaches the full weight.

Tolerances: float32 with torch's defaults (rtol 1.3e-6, atol 1e-5) where a layer's output is
compared with ``F.linear`` / ``F.embedding`` on the gathered weights (the same products, summed
in another order); exact for copies, slices and zero padding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nxd_state.testing import run_distributed, run_named_checks

TP = 4
EXACT = {"rtol": 0.0, "atol": 0.0}


def _gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    from neuronx_distributed.parallel_layers.parallel_state import get_tensor_model_parallel_group
    from nxd_state import collectives

    return collectives.all_gather(
        tensor.contiguous(), group=get_tensor_model_parallel_group(), dim=dim
    )


def check_column_bias(rank: int) -> None:
    from neuronx_distributed.parallel_layers import ColumnParallelLinear

    layer = ColumnParallelLinear(8, 12, gather_output=True, keep_master_weight=True)
    state = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {"weight": (3, 8), "bias": (12,)}
    assert not getattr(layer.bias, "tensor_model_parallel", False)  # replicated: counted once
    assert all(torch.equal(b, layer.bias) for b in _gather(layer.bias.detach(), 0).view(TP, 12))
    torch.testing.assert_close(layer.weight, layer.master_weight.chunk(TP)[rank], **EXACT)
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.master_weight, layer.bias))
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    torch.testing.assert_close(layer.bias.grad, grad_out.sum((0, 1)))  # the full bias gradient
    torch.testing.assert_close(
        layer.weight.grad, (grad_out.flatten(0, 1).T @ x.detach().flatten(0, 1)).chunk(TP)[rank]
    )
    sharded = ColumnParallelLinear(8, 12, gather_output=False)
    assert tuple(sharded.bias.shape) == (3,)
    assert sharded.bias.tensor_model_parallel
    assert sharded.bias.partition_dim == 0


def check_embedding_padding_idx(rank: int) -> None:
    from neuronx_distributed.parallel_layers.layers import ParallelEmbedding

    embedding = ParallelEmbedding(16, 4, 5)  # padding_idx third, positional
    # rows [4r, 4r + 4) live on rank r: row 5 is local row 1 of rank 1, and nowhere else
    assert embedding.padding_idx == (1 if rank == 1 else None)
    table = _gather(embedding.weight.detach(), 0)
    assert not table[5].any()
    ids = torch.tensor([[5, 3, 9, 5]])
    out = embedding(ids)
    torch.testing.assert_close(out, F.embedding(ids, table))
    out.sum().backward()
    assert not _gather(embedding.weight.grad, 0)[5].any()  # the padding row learns nothing

    def half(weight: torch.Tensor) -> torch.Tensor:
        return nn.init.constant_(weight, 0.5)

    by_reference_page = ParallelEmbedding(16, 4, half)  # a callable third is init_method
    assert by_reference_page.padding_idx is None
    assert bool((by_reference_page.weight == 0.5).all())


def check_embedding_sequence_parallel(rank: int) -> None:
    from neuronx_distributed.parallel_layers.layers import ParallelEmbedding

    embedding = ParallelEmbedding(16, 4, sequence_parallel_enabled=True)
    ids = torch.randint(0, 16, (2, 8))  # [b, s]
    out = embedding(ids)
    assert tuple(out.shape) == (8 // TP, 2, 4)  # [s/tp, b, h]
    full = F.embedding(ids, _gather(embedding.weight.detach(), 0))  # [b, s, h]
    torch.testing.assert_close(out, full.transpose(0, 1).chunk(TP, dim=0)[rank])


def check_pad_model_per_rank(rank: int) -> None:
    from neuronx_distributed.parallel_layers import ColumnParallelLinear, RowParallelLinear
    from neuronx_distributed.parallel_layers.pad import pad_model

    class Attention(nn.Module):  # 3 heads of 4: not divisible by TP=4
        def __init__(self) -> None:
            super().__init__()
            self.q = ColumnParallelLinear(8, 12, gather_output=False)
            self.o = RowParallelLinear(12, 8, input_is_parallel=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.q(x))

    model = nn.Sequential()
    model.add_module("attn", Attention())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8)
    y_before = model(x)
    ratios = []
    pad_model(model, TP, 3, wrapped_classes=(Attention,), pad_hook_fn=lambda m, r: ratios.append(r))
    assert ratios
    assert set(ratios) == {4 / 3}
    after = model.state_dict()
    assert sorted(after) == sorted(before)  # same keys: padded checkpoints interchange
    shapes = {k: tuple(v.shape) for k, v in after.items()}
    assert shapes == {
        "attn.q.weight": (4, 8),
        "attn.q.bias": (4,),
        "attn.o.weight": (8, 4),
        "attn.o.bias": (8,),
    }
    # Each rank's own shard, then its zeros (padded heads spread over the ranks).
    torch.testing.assert_close(after["attn.q.weight"][:3], before["attn.q.weight"], **EXACT)
    torch.testing.assert_close(after["attn.q.bias"][:3], before["attn.q.bias"], **EXACT)
    torch.testing.assert_close(after["attn.o.weight"][:, :3], before["attn.o.weight"], **EXACT)
    assert not after["attn.q.weight"][3:].any()
    assert not after["attn.q.bias"][3:].any()
    assert not after["attn.o.weight"][:, 3:].any()
    torch.testing.assert_close(model(x), y_before)  # zero rows meet zero columns


def check_gqa_master_weights(rank: int, facts: dict) -> None:
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import parallel_state

    hidden, heads, kv_heads, head_dim = 8, 4, 2, 2
    sizes = [heads * head_dim, kv_heads * head_dim]
    layer = GQAQKVColumnParallelLinear(
        hidden,
        sizes,
        bias=False,
        gather_output=False,
        keep_master_weight=True,
        kv_size_multiplier=2,
    )
    assert sorted(layer.state_dict()) == ["weight_k", "weight_q", "weight_v"]
    masters = {p: getattr(layer, f"master_weight_{p}") for p in "qkv"}
    assert tuple(masters["q"].shape) == (8, 8)
    assert tuple(masters["k"].shape) == tuple(masters["v"].shape) == (4, 8)  # unreplicated
    torch.testing.assert_close(layer.weight_q, masters["q"].chunk(TP)[rank], **EXACT)
    held = {}
    for part in "kv":  # each rank holds one whole KV head (2 heads x 2 replicas = 4 ranks)
        local = getattr(layer, f"weight_{part}")
        assert tuple(local.shape) == (head_dim, hidden)
        matches = [h for h, w in enumerate(masters[part].split(head_dim)) if torch.equal(w, local)]
        assert len(matches) == 1, matches
        held[part] = matches[0]
    assert held["k"] == held["v"]
    facts["kv_head"] = held["k"]
    fused = GQAQKVColumnParallelLinear(
        hidden, sizes, bias=False, gather_output=False, keep_master_weight=True,
        kv_size_multiplier=2, fuse_qkv=True,
    )  # fmt: skip
    assert sorted(fused.state_dict()) == ["weight_qkv"]
    assert tuple(fused.weight_qkv.shape) == (3 * head_dim, hidden)  # local Q, K, V rows
    assert tuple(fused.master_weight_qkv.shape) == (16, 8)  # [Q; K; V], unreplicated
    assert fused.master_weight_q is fused.master_weight_k is fused.master_weight_v is None
    try:  # NxD's GQA layer builds the KV-shared groups (parallel_state.initialize_kv_group)
        facts["kv_shared_groups"] = parallel_state.get_kv_shared_group(as_list=True)
    except Exception as error:
        facts["kv_shared_groups"] = f"{type(error).__name__}: {error}"


def check_init_weights_after_meta(rank: int) -> None:
    """NxD's Llama/Mixtral ``init_weights(module)`` on a model built on the meta device."""
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers.layers import (
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
    )
    from neuronx_distributed.parallel_layers.parallel_state import destroy_kv_group
    from neuronx_distributed.utils.model_utils import init_on_device

    def normal(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, std=0.02)  # config.initializer_range

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = ParallelEmbedding(16, 8, 0, init_method=normal)
            self.qkv = GQAQKVColumnParallelLinear(
                8, [4 * 2, 2 * 2], gather_output=False, init_method=normal,
                kv_size_multiplier=2, head_dim=2,
            )  # fmt: skip
            self.o = RowParallelLinear(8, 8, input_is_parallel=True, init_method=normal)
            self.up = ColumnParallelLinear(8, 16, gather_output=False, init_method=normal)

    def init_weights(module: nn.Module) -> None:  # as NxD's examples write it
        if isinstance(module, (ParallelEmbedding, RowParallelLinear, ColumnParallelLinear)):
            module.init_weight_cpu()
            if hasattr(module, "bias") and module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, GQAQKVColumnParallelLinear):
            module.initialize_weight_biases()

    destroy_kv_group()  # check_gqa_master_weights built them with the same m; start afresh
    with init_on_device(torch.device("meta")):
        block = Block()
    assert all(p.is_meta for p in block.parameters())
    block.to_empty(device="cpu")
    torch.manual_seed(7)
    block.apply(init_weights)
    torch.manual_seed(7)  # one process, the same draws in the same order on full tensors
    embed = torch.empty(16, 8).normal_(std=0.02)
    embed[0] = 0.0
    q, k, v = (torch.empty(n, 8).normal_(std=0.02) for n in (8, 4, 4))
    bound = 1 / 8**0.5
    b_q, b_k, b_v = (torch.empty(n).uniform_(-bound, bound) for n in (8, 4, 4))
    o, up = torch.empty(8, 8).normal_(std=0.02), torch.empty(16, 8).normal_(std=0.02)
    torch.testing.assert_close(_gather(block.embed.weight.detach(), 0), embed, **EXACT)
    torch.testing.assert_close(_gather(block.o.weight.detach(), 1), o, **EXACT)
    torch.testing.assert_close(_gather(block.up.weight.detach(), 0), up, **EXACT)
    assert not block.o.bias.any()
    assert not block.up.bias.any()
    torch.testing.assert_close(block.qkv.weight_q, q.chunk(TP)[rank], **EXACT)
    torch.testing.assert_close(block.qkv.bias_q, b_q.chunk(TP)[rank], **EXACT)
    head = rank // 2  # nxd's KV order: KV head r // m on rank r
    for local, full in ((block.qkv.weight_k, k), (block.qkv.weight_v, v)):
        torch.testing.assert_close(local, full.split(2)[head], **EXACT)
    for local, full in ((block.qkv.bias_k, b_k), (block.qkv.bias_v, b_v)):
        torch.testing.assert_close(local, full.split(2)[head], **EXACT)


def layer_semantics() -> dict:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.random import model_parallel_xla_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = parallel_state.get_tensor_model_parallel_rank()
    model_parallel_xla_manual_seed(0)
    facts: dict = {}
    names = run_named_checks(
        {
            "column gather_output=True keeps the full bias": lambda: check_column_bias(rank),
            "embedding padding_idx third": lambda: check_embedding_padding_idx(rank),
            "embedding SP output [s/tp, b, h]": lambda: check_embedding_sequence_parallel(rank),
            "pad_model pads each rank's shard": lambda: check_pad_model_per_rank(rank),
            "GQA master weights": lambda: check_gqa_master_weights(rank, facts),
            "init_weights after a meta build": lambda: check_init_weights_after_meta(rank),
        },
        context=f"tp rank {rank}",
    )
    return {"checks": names, **facts}


@functools.cache
def _results() -> tuple[dict, ...]:
    return tuple(run_distributed(layer_semantics, TP))


def test_nxd_layer_semantics() -> None:
    results = _results()
    assert all(len(r["checks"]) == 6 for r in results)
    # 2 KV heads x kv_size_multiplier 2 over 4 ranks: each head on exactly 2 ranks
    assert sorted(r["kv_head"] for r in results) == [0, 0, 1, 1]


def test_gqa_kv_head_order_and_the_map_to_nxds_layout() -> None:
    """A deliberate difference (README, Porting from NxD): NxD repeats K/V block-wise (rank r
    holds KV head r % kv_heads) and regroups Q heads in its checkpoints to match; nxd repeats each
    head in place (rank r holds head r // m), which equals the unsharded attention with no
    regrouping. ``neuronx_gqa_rank_map`` says which nxd rank holds what NxD's rank r holds."""
    from nxd_layers import neuronx_gqa_rank_map

    heads = [r["kv_head"] for r in _results()]
    assert heads == [rank // 2 for rank in range(TP)]
    mapping = neuronx_gqa_rank_map(8, 2, TP, 2)
    nxd_heads_of_nxd_ranks = [rank % 2 for rank in range(TP)]  # NxD's block-wise order
    assert [heads[mapping[r]] for r in range(TP)] == nxd_heads_of_nxd_ranks


def test_gqa_layer_initializes_kv_shared_groups() -> None:
    """NxD's GQA layer with ``kv_size_multiplier`` m > 1 builds the KV-shared groups
    (``initialize_kv_group(m)``), so ``get_kv_shared_group()`` works after building one. The
    order is a deliberate difference that follows from the head order above: NxD repeats K/V
    block-wise, so the ranks sharing a KV head are interleaved (``[[0, 2], [1, 3]]`` at TP=4,
    m=2, its default); nxd repeats each head in place, so they are adjacent and nxd's layer
    builds ``initialize_kv_group(m, sequential_ranks_in_group=True)``: ``[[0, 1], [2, 3]]``,
    the ranks that hold KV head 0 and KV head 1 (``neuronx_gqa_rank_map`` maps NxD's layout)."""
    results = _results()
    assert [r["kv_shared_groups"] for r in results] == [[[0, 1], [2, 3]]] * TP
    for group in results[0]["kv_shared_groups"]:  # each group: the ranks holding one KV head
        assert len({results[rank]["kv_head"] for rank in group}) == 1
