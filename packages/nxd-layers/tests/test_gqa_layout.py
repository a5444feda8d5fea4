"""GQA KV replication at TP=8 with 2 KV heads (kv_size_multiplier 4): the head order, pinned.

8 Q heads, 2 KV heads of head_dim 2. Here rank r holds Q head r and KV head r // 4 (each KV
head replicated head by head over the 4 ranks whose Q heads attend to it). NxD's layout, from
its checkpoint converter: K/V repeated block-wise (``W.repeat(4, 1)``, rank r holds KV head
r % 2) and Q head groups reordered so rank r holds Q group (r % 2) * 4 + r // 2. The test
builds NxD's per-rank tensors from those rules and checks that NxD's rank r equals this
layout's rank ``neuronx_gqa_rank_map(...)[r]`` for Q, K and V; it also checks NxD's
``master_weight_q/k/v`` / ``master_weight_qkv``, the public ``kv_replica_rows()`` map
against the rows each rank holds, and the layer against ``nn.Linear``.

Tolerance: exact for copies and slices; fp32 with torch's defaults (rtol=1.3e-6, atol=1e-5)
for the projections (the same products, a few ulps).
"""

from __future__ import annotations

import torch
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


def gqa_layout() -> dict[str, object]:
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = nxd_state.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    layer = GQAQKVColumnParallelLinear(
        HIDDEN, [HEADS * HD, KV * HD], kv_size_multiplier=MULT, keep_master_weight=True
    )
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
    return {"rank_map": rank_map, "kv_head": rank // MULT}


def test_gqa_replicated_head_order_at_tp8() -> None:
    results = run_distributed(gqa_layout, TP)
    assert results[0]["rank_map"] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert [r["kv_head"] for r in results] == [0, 0, 0, 0, 1, 1, 1, 1]
