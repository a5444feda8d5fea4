"""GQA KV replication at TP=8 with 2 KV heads (kv_size_multiplier 4): the head order, pinned.

8 Q heads, 2 KV heads of head_dim 2. Here rank r holds Q head r and KV head r // 4 (each KV
head replicated head by head over the 4 ranks whose Q heads attend to it). NxD's layout, from
its checkpoint converter: K/V repeated block-wise (``W.repeat(4, 1)``, rank r holds KV head
r % 2) and Q head groups reordered so rank r holds Q group (r % 2) * 4 + r // 2. The test
builds NxD's per-rank tensors from those rules and checks that NxD's rank r equals this
layout's rank ``neuronx_gqa_rank_map(...)[r]`` for Q, K and V; it also checks NxD's
``master_weight_q/k/v`` / ``master_weight_qkv``, the public ``kv_replica_rows()`` map
against the rows each rank holds, and the layer against ``nn.Linear``.

KV-shared groups: as NxD's layer does (``initialize_kv_group(m)``), the first layer with
``kv_size_multiplier`` m > 1 builds them, here m adjacent ranks
(``sequential_ranks_in_group=True``), and they are exactly the ranks whose K and V shards are
equal (checked on the gathered weights); a layer with the same m reuses them, one with another
m (or groups the user built in NxD's interleaved order) keeps what exists and logs a warning.

Tolerance: exact for copies and slices; fp32 with torch's defaults (rtol=1.3e-6, atol=1e-5)
for the projections (the same products, a few ulps).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import nxd_state
from nxd_layers import GQAQKVColumnParallelLinear, full_tensor, neuronx_gqa_rank_map
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}
FP32 = {"rtol": 1.3e-6, "atol": 1e-5}
TP, HEADS, KV, HD, HIDDEN = 8, 8, 2, 2, 8
MULT = TP // KV


def _neuronx_layout(master: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """NxD's per-rank rows of the unreplicated master (rules restated in the docstring)."""
    if kind in "kv":
        return list(master.repeat(MULT, 1).chunk(TP))
    groups = master.reshape(TP, -1, master.shape[-1])  # TP groups of HEADS / TP Q heads
    return [groups[(r % KV) * (TP // KV) + r // KV] for r in range(TP)]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_kv_shared_groups(layer: GQAQKVColumnParallelLinear, rank: int) -> list[list[int]]:
    """The groups the layer built are the ranks holding equal K/V shards; later layers keep
    them (another multiplier, or user-built interleaved groups: a warning)."""
    groups = nxd_state.get_kv_shared_group(as_list=True)
    mine = dist.get_process_group_ranks(nxd_state.get_kv_shared_group())
    assert nxd_state.get_kv_shared_group_size() == MULT
    for part in "kv":
        shards = full_tensor(getattr(layer, f"weight_{part}")).chunk(TP)
        holders = [r for r in range(TP) if torch.equal(shards[r], shards[rank])]
        assert holders == mine, (part, holders, mine)
    records = _Records()
    logging.getLogger("nxd_layers.qkv_linear").addHandler(records)
    try:
        group = nxd_state.get_kv_shared_group()
        GQAQKVColumnParallelLinear(HIDDEN, [HEADS * HD, KV * HD], kv_size_multiplier=MULT)
        assert nxd_state.get_kv_shared_group() is group  # the same m: reused, no warning
        assert records.messages == []
        GQAQKVColumnParallelLinear(HIDDEN, [HEADS * HD, HD], kv_size_multiplier=TP)  # 1 KV head
        assert nxd_state.get_kv_shared_group() is group  # kept, with a warning
        assert len(records.messages) == 1
        assert "(kv_size_multiplier=8): keeping the KV-shared groups" in records.messages[0]
        assert "kv_shared_group_size=4, sequential_ranks_in_group=True" in records.messages[0]
        nxd_state.destroy_kv_group()
        nxd_state.initialize_kv_group(MULT)  # NxD's default order, built by the user
        interleaved = nxd_state.get_kv_shared_group(as_list=True)
        GQAQKVColumnParallelLinear(HIDDEN, [HEADS * HD, KV * HD], kv_size_multiplier=MULT)
        assert nxd_state.get_kv_shared_group(as_list=True) == interleaved
        assert "sequential_ranks_in_group=False" in records.messages[-1]
        nxd_state.destroy_kv_group()
        GQAQKVColumnParallelLinear(HIDDEN, [HEADS * HD, HEADS * HD], head_dim=HD)  # m = 1
        assert not records.messages[2:]
        with pytest.raises(RuntimeError, match="KV-shared group is not initialized"):
            nxd_state.get_kv_shared_group()
    finally:
        logging.getLogger("nxd_layers.qkv_linear").removeHandler(records)
    return groups


def gqa_layout() -> dict[str, object]:
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = nxd_state.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    layer = GQAQKVColumnParallelLinear(
        HIDDEN, [HEADS * HD, KV * HD], kv_size_multiplier=MULT, keep_master_weight=True
    )
    kv_groups = check_kv_shared_groups(layer, rank)
    masters = {p: getattr(layer, f"master_weight_{p}") for p in "qkv"}
    assert masters["k"].shape == (KV * HD, HIDDEN)  # unreplicated, as NxD keeps it
    # This layout: rank r holds Q head r and KV head r // 4.
    for part in "kv":
        head = masters[part].reshape(KV, HD, HIDDEN)[rank // MULT]
        torch.testing.assert_close(getattr(layer, f"weight_{part}"), head, **EXACT)
    torch.testing.assert_close(layer.weight_q, masters["q"].chunk(TP)[rank], **EXACT)
    # The public replica-row map says which unreplicated rows each rank's K/V rows copy.
    rows = torch.tensor(layer.kv_replica_rows()).chunk(TP)[rank]
    for part in "kv":
        torch.testing.assert_close(getattr(layer, f"weight_{part}"), masters[part][rows], **EXACT)
    # NxD's rank r holds what this layout's rank rank_map[r] holds.
    rank_map = neuronx_gqa_rank_map(HEADS, KV, TP, MULT)
    for part in "qkv":
        ours = full_tensor(getattr(layer, f"weight_{part}")).chunk(TP)  # every rank's rows
        theirs = _neuronx_layout(masters[part], part)
        for r in range(TP):
            torch.testing.assert_close(ours[rank_map[r]], theirs[r], **EXACT, msg=f"{part} {r}")
    # The layer equals three nn.Linear on the masters, outputs and input gradient.
    gathered = GQAQKVColumnParallelLinear(
        HIDDEN, [HEADS * HD, KV * HD], bias=False, kv_size_multiplier=MULT, fuse_qkv=True,
        keep_master_weight=True,
    )  # fmt: skip
    fused = gathered.master_weight_qkv
    assert fused.shape == ((HEADS + 2 * KV) * HD, HIDDEN)
    assert gathered.master_weight_q is None
    x = torch.randn(2, 3, HIDDEN)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    refs = [F.linear(x_ref, w) for w in fused.split([HEADS * HD, KV * HD, KV * HD])]
    outs = gathered(x_par)
    ups = [torch.randn_like(r) for r in refs]
    sum((o * u).sum() for o, u in zip(refs, ups)).backward()
    sum((o * u).sum() for o, u in zip(outs, ups)).backward()
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
    return {"rank_map": rank_map, "kv_head": rank // MULT, "kv_groups": kv_groups}


def test_gqa_replicated_head_order_at_tp8() -> None:
    results = run_distributed(gqa_layout, TP)
    assert results[0]["rank_map"] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert [r["kv_head"] for r in results] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(r["kv_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]] for r in results)
