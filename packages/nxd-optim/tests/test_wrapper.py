"""NxDOptimizer follows single-process training: DP gradient averaging (bucketed all-reduce or
ZeRO-1), clipping with grad_norm, micro-batch accumulation, LR schedulers, and TP=2 x DP=2 with
sequence parallelism.

Tolerances (fp32): the data-parallel and micro-batch means re-associate the reference's batch
mean and TP splits its matmul sums, which changes gradients by a few ulps; Adam keeps that
relative, so parameters agree to rtol 1e-5 / atol 1e-6 after 5 steps at lr 1e-2.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import nxd_state
from nxd_optim import NxDOptimizer, OptimizerConfig, build_optimizer
from nxd_state.testing import run_distributed

STEPS = 5
TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 7, generator=gen), torch.randn(rows, 5, generator=gen)


def _train_with_accumulation(zero: bool, bucket_cap_mb: float | None = None) -> list[float]:
    state = nxd_state.get_parallel_state()
    dp, rank = state.data_parallel_size, state.data_parallel_rank
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    if bucket_cap_mb is None:  # NxD's config dict
        opt = build_optimizer(
            {"zero_one_enabled": zero, "grad_clipping": True, "max_grad_norm": 0.05},
            torch.optim.AdamW,
            _groups(model),
            lr=1e-2,
        )
    else:
        config = OptimizerConfig(max_grad_norm=0.05, bucket_cap_mb=bucket_cap_mb)
        opt = NxDOptimizer(_groups(model), torch.optim.AdamW, config=config, lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert opt.grad_norm is None  # NxD: None before the first step
    norms = []
    micro_batches = 2
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
        ref_sched.step()

        opt.zero_grad()
        local_x, local_y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        with nxd_state.count_collectives() as during_backward:
            for mx, my in zip(local_x.chunk(micro_batches), local_y.chunk(micro_batches)):
                (nn.functional.mse_loss(model(mx), my) / micro_batches).backward()
        assert during_backward.stats == {}, "accumulation must not communicate"
        with nxd_state.count_collectives() as during_step:
            opt.step()
        sched.step()
        ops = {op: stats for (op, _), stats in during_step.stats.items()}
        if zero:
            # On gloo ZeRO-1 all-reduces each group's flat gradient (gloo's reduce-scatter is an
            # all-reduce in disguise) and all-gathers the params; every rank then holds the
            # whole gradient, so the clipping norm needs no collective. Groups of 156 and 44
            # fp32 elements (both even: no padding at DP=2) = 800 bytes.
            assert set(ops) == {"all_gather", "all_reduce"}, ops
            assert (ops["all_reduce"].calls, ops["all_reduce"].bytes) == (2, 800), ops
            assert (ops["all_gather"].calls, ops["all_gather"].bytes) == (2, 400), ops
        else:
            assert set(ops) == {"all_reduce"}, ops
            # 200 fp32 gradients = 800 bytes: one bucket by default; with a 256-byte cap the
            # tensors in group order (364, 260 | 52, 52, 52, 20 bytes) pack into 3 buckets
            assert ops["all_reduce"].calls == (1 if bucket_cap_mb is None else 3), ops
            assert ops["all_reduce"].bytes == 800, ops
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        torch.testing.assert_close(opt.grad_norm, torch.tensor(norms[-1]), **TOL)
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(p, p_ref, **TOL)
    return norms


def _data_parallel_suite() -> list[list[float]]:
    nxd_state.initialize_model_parallel()
    # A frozen param is neither synchronised nor updated (weight decay included).
    model = _model()
    model[0].weight.requires_grad_(False)
    frozen, trained = model[0].weight.detach().clone(), model[3].weight.detach().clone()
    opt = NxDOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert model[0].weight.grad is None
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[3].weight, trained)

    small_buckets = _train_with_accumulation(zero=False, bucket_cap_mb=256 / 2**20)
    plain, zero = _train_with_accumulation(zero=False), _train_with_accumulation(zero=True)
    torch.testing.assert_close(small_buckets, plain, **TOL)
    return [plain, zero]


def test_wrapper_dp2_with_and_without_zero1_matches_single_process() -> None:
    results = run_distributed(_data_parallel_suite, 2)
    plain, zero = results[0]
    assert min(plain) > 0.05  # every step exercised clipping
    torch.testing.assert_close(plain, zero, **TOL)  # both paths see the same gradients


def _sequence_parallel_suite(zero: bool) -> list[float]:
    from nxd_layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        full_tensor,
        mark_sequence_parallel_parameter,
    )

    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp, tp_size = state.tensor_parallel_rank, state.tensor_parallel_size
    dp, dp_rank = state.data_parallel_size, state.data_parallel_rank
    torch.manual_seed(0)
    ref = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    norm = copy.deepcopy(ref[0])
    for param in norm.parameters():
        mark_sequence_parallel_parameter(param)  # replicated, sees only its sequence shard
    par = nn.Sequential(
        norm,
        ColumnParallelLinear(8, 16, gather_output=False, sequence_parallel_enabled=True),
        nn.ReLU(),
        RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel_enabled=True),
    )
    with torch.no_grad():
        par[1].weight.copy_(ref[1].weight.chunk(tp_size)[tp])
        par[1].bias.copy_(ref[1].bias.chunk(tp_size)[tp])
        par[3].weight.copy_(ref[3].weight.chunk(tp_size, dim=1)[tp])
        par[3].bias.copy_(ref[3].bias)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    config = OptimizerConfig(zero_one_enabled=zero, max_grad_norm=0.05)
    opt = NxDOptimizer(par.parameters(), torch.optim.AdamW, config=config, lr=1e-2)
    norms = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 4, 8, generator=gen), torch.randn(4, 4, 8, generator=gen)  # (T, B, H)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
        # this rank: sequence shard tp, batch shard dp; Σ over TP of the local losses is the
        # mean over the local batch
        local_x = x.chunk(tp_size, dim=0)[tp].chunk(dp, dim=1)[dp_rank]
        local_y = y.chunk(tp_size, dim=0)[tp].chunk(dp, dim=1)[dp_rank]
        opt.zero_grad()
        loss = (par(local_x) - local_y).pow(2).sum() / (x.shape[0] * local_x.shape[1] * 8)
        loss.backward()
        opt.step()
        torch.testing.assert_close(opt.grad_norm, torch.tensor(norms[-1]), **TOL)
        for p_ref, p in zip(ref.parameters(), par.parameters()):
            torch.testing.assert_close(full_tensor(p), p_ref.detach(), **TOL)
    return norms


def _sequence_parallel_both() -> list[list[float]]:
    return [_sequence_parallel_suite(zero=False), _sequence_parallel_suite(zero=True)]


def test_wrapper_tp2_dp2_sequence_parallel_matches_single_process() -> None:
    results = run_distributed(_sequence_parallel_both, 4)
    assert min(results[0][0]) > 0.05  # clipping exercised
    assert all(r == results[0] for r in results)  # every rank saw the same norms
