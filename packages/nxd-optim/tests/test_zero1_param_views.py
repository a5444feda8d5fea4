"""ZeRO-1 params as views of their bucket's flat buffer (``parameters_as_bucket_view``), DP=2.

With views the all-gather writes the updated shards straight into the params; without, it
gathers into a temporary and copies. Both run the same arithmetic, so every run below must
give **bit-identical** params after every step (``torch.equal``): views, copies, views with a
capped all-gather (column blocks through temporaries), and views where one param's storage was
replaced by the user after the first step (that param no longer views the buffer and must be
updated by a copy, not left stale). The model mixes a bf16 and an fp32 bucket, each viewing a
buffer of its own dtype. That the shared arithmetic matches one process is
test_zero1_parity.py's and test_zero1_mixed_dtype.py's job (they run with views, the default).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import nxd_state
from nxd_optim import NeuronZero1Optimizer
from nxd_state.testing import run_distributed

STEPS = 3
GATHER_CAP_ELEMENTS = 40  # forces column blocks in the bf16 bucket (174 elements), not fp32 (26)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))
    model[0].bfloat16()
    model[3].bfloat16()
    return model


def _forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    h = model[0](x.bfloat16()).float()
    return model[3](model[2](model[1](h)).bfloat16()).float()


def _views_suite() -> dict:
    state = nxd_state.initialize_model_parallel()
    rank = state.data_parallel_rank
    reference = _model()
    runs: dict[str, tuple[nn.Sequential, NeuronZero1Optimizer]] = {}
    before_ptrs = {}
    for name in ("copies", "views", "capped", "detached"):
        model = copy.deepcopy(reference)
        before_ptrs[name] = [p.data_ptr() for p in model.parameters()]
        kwargs = {"parameters_as_bucket_view": name != "copies"}
        if name == "capped":
            kwargs["bucket_cap_mb_all_gather"] = GATHER_CAP_ELEMENTS * 4 / 2**20
        opt = NeuronZero1Optimizer(
            list(model.parameters()), torch.optim.AdamW, lr=1e-2, max_norm=1.0, **kwargs
        )
        runs[name] = (model, opt)

    checks: dict = {}
    model, opt = runs["views"]
    buckets = opt.dtype_buckets
    checks["bucket_dtypes"] = [(b.dtype, b.views.flat.dtype) for b in buckets]
    checks["every_param_views_its_buffer"] = all(
        p.data_ptr() == view.data_ptr()
        and p.untyped_storage().data_ptr() == b.views.flat.untyped_storage().data_ptr()
        for b in buckets
        for p, view in zip(b.params(opt.param_groups[0]["params"]), b.views.views)
    )
    copies_opt = runs["copies"][1]
    checks["copies_have_no_views"] = all(b.views is None for b in copies_opt.dtype_buckets)
    checks["copies_keep_storage"] = before_ptrs["copies"] == [
        p.data_ptr() for p in runs["copies"][0].parameters()
    ]

    gen = torch.Generator().manual_seed(100 + rank)
    mismatches, detached_after = [], None
    with nxd_state.count_collectives() as counter:
        for step in range(STEPS):
            x = torch.randn(4, 7, generator=gen)
            for model, opt in runs.values():
                opt.zero_grad()
                _forward(model, x).pow(2).mean().backward()
                opt.step()
            if step == 0:  # the user replaces one param's storage: it stops viewing F
                target = runs["detached"][0][1].weight
                target.data = target.data.clone()
                bucket = next(
                    b for b in runs["detached"][1].dtype_buckets if b.dtype == torch.float32
                )
                detached_after = bucket.views.detached(
                    bucket.params(runs["detached"][1].param_groups[0]["params"])
                )
            expected = list(runs["copies"][0].parameters())
            for name in ("views", "capped", "detached"):
                for i, (got, want) in enumerate(zip(runs[name][0].parameters(), expected)):
                    if not (got.dtype == want.dtype and torch.equal(got, want)):
                        mismatches.append((step, name, i))
    moved = [
        float((p.float() - q.float()).abs().max())
        for p, q in zip(runs["views"][0].parameters(), reference.parameters())
    ]
    checks["mismatches"] = mismatches
    checks["detached_positions"] = detached_after
    checks["detached_still_own_storage"] = (
        runs["detached"][0][1].weight.data_ptr() != bucket.views.views[0].data_ptr()
    )
    checks["min_moved"] = min(moved)
    checks["all_gather_calls"] = counter.total(op="all_gather").calls
    return checks


def test_views_copies_capped_and_detached_params_train_bit_identically() -> None:
    for checks in run_distributed(_views_suite, 2):
        bf16, fp32 = torch.bfloat16, torch.float32
        assert checks["bucket_dtypes"] == [(bf16, bf16), (fp32, fp32)]
        assert checks["every_param_views_its_buffer"]
        assert checks["copies_have_no_views"]
        assert checks["copies_keep_storage"]
        assert checks["mismatches"] == []
        # the fp32 bucket holds the LayerNorm's weight and bias: the weight (position 0) was
        # replaced, it stays the user's own storage and is still updated (mismatches above)
        assert checks["detached_positions"] == [0]
        assert checks["detached_still_own_storage"]
        assert checks["min_moved"] > 1e-3  # every param trained, so equality can fail
        # per step, 2 buckets: one all-gather each in views/copies/detached; the capped run
        # moves the bf16 bucket (91 + 13 + 65 + 5 = 174 elements, 87 per rank) in 5 column
        # blocks of 20 columns (<= 40 elements) and the fp32 bucket (26 elements) in 1
        assert checks["all_gather_calls"] == STEPS * (2 + 2 + (5 + 1) + 2)
