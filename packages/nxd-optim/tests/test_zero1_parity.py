"""ZeRO-1 follows single-process training step by step (gloo; DP=2, DP=4, TP=2 x DP=2).

Each rank trains a deep copy of the reference model on its slice of the global batch while
the reference trains on the whole batch in the same process; parameters are compared after
every step. Tolerances: fp32 everywhere; the data-parallel mean (1/n) Σ_r mean(loss_r)
re-associates the reference's mean over the batch, a few ulps of difference in the gradient,
which Adam's g/√v normalisation keeps relative, so after 5 steps the parameters agree to
rtol 1e-5 / atol 1e-6 (lr 1e-2: an ulp-level gradient change moves a parameter by ≪ 1e-6).
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from torch import nn

import nxd_state
from nxd_optim import NeuronZero1Optimizer
from nxd_state.testing import run_distributed

STEPS = 5
GLOBAL_BATCH = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring


def _model() -> nn.Module:
    # Parameter sizes 91, 13, 13, 13, 65, 5: groups of 156 and 44 elements, which straddle the
    # shard boundaries of 2 and 4 ranks.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 5, generator=gen)


def _local(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    per = tensor.shape[0] // size
    return tensor[rank * per : (rank + 1) * per]


def _train_and_compare(
    optimizer_class: type[torch.optim.Optimizer],
    max_norm: float | None,
    add_group_later: bool = False,
    **hyper: float,
) -> dict:
    """Train reference and ZeRO-1 copy side by side; assert equal params after every step."""
    state = nxd_state.get_parallel_state()
    dp, rank = state.data_parallel_size, state.data_parallel_rank
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = optimizer_class(_groups(ref), **hyper)
    groups = _groups(model)
    opt = NeuronZero1Optimizer(
        groups[:1] if add_group_later else groups,
        optimizer_class,
        grad_clipping=max_norm is not None,
        max_norm=max_norm,
        sharding_groups=nxd_state.get_data_parallel_group(as_list=True),
        **hyper,
    )
    if add_group_later:  # a group added after construction gets its own shard
        opt.add_param_group(groups[1])
        assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.grad_norm is None
    loss_fn = nn.MSELoss()
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        ref_opt.step()
        opt.zero_grad()
        loss_fn(model(_local(x, rank, dp)), _local(y, rank, dp)).backward()
        opt.step()
        if max_norm is not None:
            # the norm of the same averaged gradient, summed in another order: fp32 ulps
            torch.testing.assert_close(opt.grad_norm, torch.tensor(norms[-1]), **TOL)
            assert norms[-1] > max_norm, "the test must exercise clipping"
        for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
            torch.testing.assert_close(
                p, p_ref, **TOL, msg=lambda m, n=name, s=step: f"{n} {s}: {m}"
            )
    full_bytes = sum(
        v.numel() * v.element_size()
        for s in ref_opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "state_bytes": opt.state_nbytes(include_master=False),
        "full_state_bytes": full_bytes,
        "straddling": [
            sum(1 for r in range(dp) if any(pc.param_index == i for pc in layout.pieces(r)))
            for layout in (bucket.layout for bucket in opt._buckets)
            for i in range(len(layout.shapes))
        ],
    }


def _data_parallel_suite() -> dict:
    nxd_state.initialize_model_parallel()
    adamw = _train_and_compare(torch.optim.AdamW, None, lr=1e-2)
    _train_and_compare(torch.optim.SGD, 0.05, lr=0.1, momentum=0.9)
    _train_and_compare(torch.optim.Adam, None, add_group_later=True, lr=1e-2)
    return adamw


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_matches_single_process_adamw_sgd_adam(dp: int) -> None:
    results = run_distributed(_data_parallel_suite, dp)
    for result in results:
        # AdamW state (exp_avg, exp_avg_sq) is sharded: per rank ≈ full / DP; the slack is the
        # padding (< DP elements per group) and one `step` scalar per group instead of per param.
        assert result["state_bytes"] <= 1.05 * result["full_state_bytes"] / dp
        # Some parameter is held by several ranks: the layout really splits parameters.
        assert max(result["straddling"]) > 1


def _tp_dp_suite() -> list[float]:
    from nxd_layers import ColumnParallelLinear, RowParallelLinear, full_tensor

    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp, dp, dp_rank = state.tensor_parallel_rank, state.data_parallel_size, state.data_parallel_rank
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6), nn.LayerNorm(6))
    par = nn.Sequential(
        ColumnParallelLinear(8, 16, gather_output=False),
        nn.ReLU(),
        RowParallelLinear(16, 6, input_is_parallel=True),
        copy.deepcopy(ref[3]),
    )
    with torch.no_grad():  # the TP model is the reference, sliced
        par[0].weight.copy_(ref[0].weight[tp * 8 : (tp + 1) * 8])
        par[0].bias.copy_(ref[0].bias[tp * 8 : (tp + 1) * 8])
        par[2].weight.copy_(ref[2].weight[:, tp * 8 : (tp + 1) * 8])
        par[2].bias.copy_(ref[2].bias)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = NeuronZero1Optimizer(
        par.parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        max_norm=0.2,
        sharding_groups=nxd_state.get_data_parallel_group(as_list=True),
        grad_norm_groups=nxd_state.get_tensor_model_parallel_group(as_list=True),
    )
    norms = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 6, generator=gen)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)))
        ref_opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(par(_local(x, dp_rank, dp)), _local(y, dp_rank, dp)).backward()
        opt.step()
        # TP splits the matmul sums and DP the batch mean: fp32 re-association only (TOL)
        torch.testing.assert_close(opt.grad_norm, torch.tensor(norms[-1]), **TOL)
        for p_ref, p in zip(ref.parameters(), par.parameters()):
            torch.testing.assert_close(full_tensor(p), p_ref.detach(), **TOL)
    return norms


def test_zero1_tp2_dp2_with_clipping_matches_single_process() -> None:
    results = run_distributed(_tp_dp_suite, 4)
    assert all(r == results[0] for r in results)
    assert min(results[0]) > 0.2  # every step clipped


def _save_load_suite(directory: str) -> dict:
    state = nxd_state.initialize_model_parallel()
    dp, rank = state.data_parallel_size, state.data_parallel_rank
    model = _model()
    opt = NeuronZero1Optimizer(_groups(model), torch.optim.AdamW, lr=1e-2, max_norm=1.0)

    def train_step(m: nn.Module, o: NeuronZero1Optimizer, step: int) -> None:
        x, y = _batch(step)
        o.zero_grad()
        nn.functional.mse_loss(m(_local(x, rank, dp)), _local(y, rank, dp)).backward()
        o.step()

    for step in range(2):
        train_step(model, opt, step)
    weights = copy.deepcopy(model.state_dict())
    opt.save_sharded_state_dict(directory)
    full = opt.full_state_dict()
    train_step(model, opt, 2)
    expected = [p.detach().clone() for p in model.parameters()]

    resumed = _model()  # fresh weights and state: everything must come from the checkpoint
    resumed.load_state_dict(weights)
    opt2 = NeuronZero1Optimizer(_groups(resumed), torch.optim.AdamW, lr=5.0, max_norm=1.0)
    opt2.load_sharded_state_dict(directory, num_workers_per_step=1)
    assert opt2.param_groups[0]["lr"] == 1e-2  # hyper-parameters come back too
    train_step(resumed, opt2, 2)
    for p, q in zip(resumed.parameters(), expected):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # same ops in the same order: exact

    # The full state dict is a plain optimizer's: torch's AdamW loads it and continues in one
    # process on the whole batch (the norm is clipped to 1.0 like the ZeRO-1 run).
    single = _model()
    single.load_state_dict(weights)
    plain = torch.optim.AdamW(_groups(single), lr=5.0)
    plain.load_state_dict(copy.deepcopy(full))  # torch aliases loaded tensors, steps in place
    x, y = _batch(2)
    nn.functional.mse_loss(single(x), y).backward()
    torch.nn.utils.clip_grad_norm_(single.parameters(), 1.0)
    plain.step()
    for p, q in zip(single.parameters(), expected):
        torch.testing.assert_close(p, q, **TOL)  # whole-batch vs DP mean: TOL
    return {"full": full, "weights": weights, "expected": expected}


def _reshard_suite(directory: str, saved: dict) -> str:
    state = nxd_state.initialize_model_parallel()
    dp, rank = state.data_parallel_size, state.data_parallel_rank
    model = _model()
    model.load_state_dict(saved["weights"])
    opt = NeuronZero1Optimizer(_groups(model), torch.optim.AdamW, lr=1e-2, max_norm=1.0)
    with pytest.raises(ValueError, match=r"holds 2 ZeRO-1 shards .* shards over 4 ranks") as info:
        opt.load_sharded_state_dict(directory)
    opt.load_full_state_dict(saved["full"])  # the gathered state reshards from 2 to 4 ranks
    x, y = _batch(2)
    opt.zero_grad()
    nn.functional.mse_loss(model(_local(x, rank, dp)), _local(y, rank, dp)).backward()
    opt.step()
    for p, q in zip(model.parameters(), saved["expected"]):
        torch.testing.assert_close(p, q, **TOL)  # 4-way instead of 2-way batch mean: TOL
    return str(info.value)


def test_sharded_save_load_resumes_exactly_and_full_state_reshards() -> None:
    with tempfile.TemporaryDirectory() as directory:
        saved = run_distributed(_save_load_suite, 2, directory)[0]
        messages = run_distributed(_reshard_suite, 4, directory, saved)
    assert "load_full_state_dict" in messages[0]
    # the full state dict is the plain optimizer's: one entry per model parameter
    assert sorted(saved["full"]["state"]) == list(range(6))
    assert saved["full"]["state"][0]["exp_avg"].shape == (13, 7)


def _pipeline_suite() -> list[float]:
    """PP=2 x DP=2: each stage's optimizer holds only its stage's params; the clipping norm must
    still be that of the whole model (reduced over stages), for ZeRO-1 and the plain wrapper."""
    from nxd_optim import NxDOptimizer, OptimizerConfig

    state = nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    dp, dp_rank, stage = (
        state.data_parallel_size,
        state.data_parallel_rank,
        state.pipeline_parallel_rank,
    )
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    norms = []
    models, optimizers = [], []
    for zero in (True, False):
        model = copy.deepcopy(ref)
        stage_params = list((model[:2] if stage == 0 else model[2:]).parameters())
        config = OptimizerConfig(zero_one_enabled=zero, max_grad_norm=0.05)
        models.append(model)
        optimizers.append(
            NxDOptimizer(stage_params, torch.optim.SGD, config=config, lr=0.1, momentum=0.9)
        )
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
        for model, opt in zip(models, optimizers):
            # both stages run the whole model locally: this test is about the optimizer, not
            # the pipeline; each optimizer only steps (and syncs) its own stage's params
            opt.zero_grad()
            nn.functional.mse_loss(model(_local(x, dp_rank, dp)), _local(y, dp_rank, dp)).backward()
            opt.step()
            torch.testing.assert_close(opt.grad_norm, torch.tensor(norms[-1]), **TOL)
            owned = range(0, 2) if stage == 0 else range(2, 4)
            for index in range(4):
                for p, p_ref in zip(model[index].parameters(), ref[index].parameters()):
                    if index in owned:
                        torch.testing.assert_close(p, p_ref, **TOL)
                    else:  # the other stage's update (checked on its ranks), for the next step
                        p.data.copy_(p_ref.detach())
    return norms


def test_pipeline_stages_share_one_clipping_norm() -> None:
    results = run_distributed(_pipeline_suite, 4)
    assert min(results[0]) > 0.05  # clipping exercised at every step
