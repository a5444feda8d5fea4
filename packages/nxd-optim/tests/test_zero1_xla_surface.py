"""What NxD code touches on NeuronZero1Optimizer (torch-xla's ZeroRedundancyOptimizer
surface), at DP=2 on gloo: ``base_optimizer`` and the other attributes, NxD's own test pattern,
``lazy_init``, the constructor flags, collective caps, the choice of gradient reduction (and
what the traffic counter says), torch-xla state dicts, and AdamW_FP32OptimParams inside.

Tolerance where a parallel run is compared with one process: fp32, the DP mean re-associates
the batch mean (ulps), which Adam keeps relative: rtol 1e-5 / atol 1e-6 (as in
test_zero1_parity.py). Where two ZeRO-1 runs differ only in how the same sums are cut into
collectives, the result is bit-identical at DP=2 (a + b is the same whichever message carries
it), and compared with zero tolerance.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_optim import AdamW_FP32OptimParams, NeuronZero1Optimizer
from nxd_state.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}
EXACT = {"rtol": 0, "atol": 0}


def _model() -> nn.Module:
    # (13, 7) and (5, 13) weights: dim 0 is odd, so torch-xla's per-param shards are padded
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)


def _local_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    state = nxd_state.get_parallel_state()
    x, y = _batch(step)
    per = 8 // state.data_parallel_size
    local = slice(state.data_parallel_rank * per, (state.data_parallel_rank + 1) * per)
    opt.zero_grad()
    F.mse_loss(model(x[local]), y[local]).backward()
    opt.step()


def _full_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, max_norm: float) -> None:
    x, y = _batch(step)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()


def _nxd_test_pattern() -> None:
    """NxD's own ZeRO-1 grad-norm test: identical grads set by hand on every rank, the inner
    optimizer's zero_grad patched out through ``base_optimizer`` to keep the shard grads."""
    from nxd_state import get_data_parallel_group, get_tensor_model_parallel_group

    rank = nxd_state.get_parallel_state().data_parallel_rank
    layer = nn.Linear(6, 10)
    reference = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(3)
    for p, q in zip(layer.parameters(), reference.parameters()):
        q.grad = 10 * torch.randn(p.shape, generator=gen)
        p.grad = q.grad.clone()
    opt = NeuronZero1Optimizer(
        list(layer.parameters()),
        torch.optim.SGD,
        lr=0.01,
        pin_layout=False,
        sharding_groups=get_data_parallel_group(as_list=True),
        grad_norm_groups=get_tensor_model_parallel_group(as_list=True),
        max_norm=1.0,
        grad_clipping=True,
    )
    opt.base_optimizer.zero_grad = lambda set_to_none: set_to_none
    opt.step()
    norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
    torch.testing.assert_close(opt.grad_norm, norm, **TOL)
    (bucket,) = opt.dtype_buckets  # one fp32 bucket: weight (60) and bias (10), 35 per rank
    assert bucket.master.grad is not None, "the patched zero_grad keeps the clipped gradient"
    flat = torch.cat([q.grad.reshape(-1) for q in reference.parameters()])  # clipped, 70 elems
    torch.testing.assert_close(bucket.master.grad, flat[rank * 35 : (rank + 1) * 35], **TOL)
    # NxD's zip: one shard per param, this rank's piece of it (rank 0: weight[:35], no bias)
    pieces = opt.base_optimizer.param_groups[0]["params"]
    assert [p.numel() for p in pieces] == ([35, 0] if rank == 0 else [25, 10])
    torch.testing.assert_close(torch.cat([p.grad for p in pieces]), bucket.master.grad, **TOL)


def _attributes() -> None:
    rank = nxd_state.get_parallel_state().data_parallel_rank
    model = _model()
    opt = NeuronZero1Optimizer(_groups(model), torch.optim.AdamW, lr=1e-2)
    assert isinstance(opt.base_optimizer, torch.optim.AdamW)
    assert opt.inner_optimizer is opt.base_optimizer
    assert opt.inited
    assert opt.grad_clipping
    assert opt.max_norm == 1.0  # torch-xla's defaults
    assert opt.optimizer_dtype == torch.float32
    assert opt.sharding_groups == [[0, 1]]  # the default, in NxD's as_list form
    assert opt.grad_norm_groups == [[0], [1]]
    assert (opt.local_world_size, opt.local_rank) == (2, rank)
    assert (opt.global_world_size, opt.global_rank) == (2, rank)
    assert opt.get_shape_info() == {
        0: (13, 7),
        1: (5, 13),
        2: (13,),
        3: (13,),
        4: (13,),
        5: (5,),
    }
    assert opt.device == torch.device("cpu")
    buckets = opt.dtype_buckets  # the public view of the shards, in base_optimizer's order
    assert [(b.group_index, b.positions, b.dtype) for b in buckets] == [
        (0, (0, 1), torch.float32),
        (1, (0, 1, 2, 3), torch.float32),
    ]
    # base_optimizer.param_groups: one piece of the master shard per param (NxD's tests zip
    # them with ours), views sharing the masters' storage
    assert [len(g["params"]) for g in opt.base_optimizer.param_groups] == [2, 4]
    storages = {b.group_index: b.master.untyped_storage().data_ptr() for b in buckets}
    for index, group in enumerate(opt.base_optimizer.param_groups):
        assert all(p.untyped_storage().data_ptr() == storages[index] for p in group["params"])
    # LR schedulers act on our param groups; the step hands them to base_optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _local_step(model, opt, 0)
    scheduler.step()
    _local_step(model, opt, 1)
    assert [g["lr"] for g in opt.base_optimizer.param_groups] == [5e-3, 5e-3]


def _lazy_init_and_flags() -> None:
    """lazy_init (groups may change until init_zero) trains exactly like eager construction;
    save_master_weights / use_grad_acc_hook are use_master_weights_in_ckpt /
    use_fp32_grad_acc under torch-xla's names; higher_cc_precision reduces in fp32."""
    eager_model, lazy_model = _model(), _model()
    eager = NeuronZero1Optimizer(_groups(eager_model), torch.optim.AdamW, lr=1e-2)
    lazy = NeuronZero1Optimizer(
        _groups(lazy_model), torch.optim.AdamW, lr=1e-2, lazy_init=True, sharding_groups=[[0], [1]]
    )
    assert not lazy.inited
    lazy.sharding_groups = [[0, 1]]  # allowed before init_zero, as in torch-xla
    lazy.init_zero()
    for step in range(3):
        _local_step(eager_model, eager, step)
        _local_step(lazy_model, lazy, step)
    for p, q in zip(lazy_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, **EXACT)

    model = _model().bfloat16()
    opt = NeuronZero1Optimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        save_master_weights=True,
        use_grad_acc_hook=True,
        higher_cc_precision=True,
    )
    assert opt.use_master_weights_in_ckpt
    assert opt.use_fp32_grad_acc
    x, y = _batch(0)
    F.mse_loss(model(x.bfloat16()).float(), y).backward()
    assert all(p.grad is None for p in model.parameters()), "accumulated into fp32 buffers"
    with nxd_state.count_collectives() as counter:
        opt.step()
    # 200 elements (even: no padding) all-reduced in fp32, then gathered as bf16 params
    assert counter.total(op="all_reduce").bytes == 200 * 4
    assert counter.total(op="all_gather").bytes == 100 * 2
    assert len(opt.state_dict()["master_weights"]) == 1


def _reductions_and_caps() -> None:
    """Both gradient reductions, with and without collective caps: the counter records the op
    that ran (all-reduce on gloo by default), caps cut the collectives, results agree."""
    results, traffic = {}, {}
    cap_mb = 160 / 2**20  # 160 bytes: 40 fp32 elements per collective
    for reduction in ("auto", "all_reduce", "reduce_scatter"):
        for capped in (False, True):
            model = _model()
            opt = NeuronZero1Optimizer(
                _groups(model),
                torch.optim.AdamW,
                lr=1e-2,
                max_norm=0.1,
                grad_reduction=reduction,
                bucket_cap_mb_reduce_scatter=cap_mb if capped else 0,
                bucket_cap_mb_all_gather=cap_mb if capped else 0,
            )
            with nxd_state.count_collectives() as counter:
                for step in range(3):
                    _local_step(model, opt, step)
            results[reduction, capped] = [p.detach().clone() for p in model.parameters()]
            traffic[reduction, capped] = {
                op: (stats.calls, stats.bytes) for (op, _), stats in counter.stats.items()
            }
    # 3 steps, groups of 156 and 44 fp32 gradient elements (even: no padding)
    assert traffic["auto", False] == traffic["all_reduce", False]
    assert traffic["all_reduce", False] == {"all_reduce": (6, 2400), "all_gather": (6, 1200)}
    # reduce-scatter: the shards' norms are summed with one fp32 scalar all-reduce per step
    assert traffic["reduce_scatter", False] == {
        "reduce_scatter": (6, 2400),
        "all_gather": (6, 1200),
        "all_reduce": (3, 12),
    }
    # capped at 40 elements: 156 -> 4 + 44 -> 2 pieces of at most 40 (20 columns x 2 rows)
    assert traffic["all_reduce", True]["all_reduce"] == (18, 2400)
    assert traffic["all_reduce", True]["all_gather"] == (18, 1200)
    assert traffic["reduce_scatter", True]["reduce_scatter"] == (18, 2400)
    for key, params in results.items():
        same_norm = key[0] != "reduce_scatter"  # the norm is summed in another order there
        for p, q in zip(params, results["auto", False]):
            torch.testing.assert_close(p, q, **(EXACT if same_norm else TOL))
    for p, q in zip(results["reduce_scatter", True], results["reduce_scatter", False]):
        torch.testing.assert_close(p, q, **EXACT)


def _xla_shards(tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """torch-xla's shard: zero-pad dim 0 to a multiple of n, take chunk ``rank``."""
    pad = -tensor.shape[0] % n
    padded = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])]) if pad else tensor
    return padded.chunk(n)[rank].clone()


def _torch_xla_state_dict() -> None:
    """A state dict in torch-xla's format (what NxD's ZeRO-1 saves per DP rank), built from a
    one-process AdamW run, loads collectively: params come back from the master shards, and
    the next step matches the reference continuing."""
    state = nxd_state.get_parallel_state()
    n, rank = state.data_parallel_size, state.data_parallel_rank
    ref = _model()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    for step in range(2):
        _full_step(ref, ref_opt, step, max_norm=1.0)
    saved = ref_opt.state_dict()
    params = [p for group in ref_opt.param_groups for p in group["params"]]  # state dict ids
    xla = {
        "state": {},
        "param_groups": copy.deepcopy(saved["param_groups"]),
        "base_state": {
            i: {
                key: value if key == "step" else _xla_shards(value, rank, n)
                for key, value in saved["state"][i].items()
            }
            for i in range(len(params))
        },
        "shape_info": {i: p.shape for i, p in enumerate(params)},
        "sharded_master_weights": {
            i: _xla_shards(p.detach(), rank, n) for i, p in enumerate(params)
        },
    }
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # everything must come from the state dict
    opt = NeuronZero1Optimizer(_groups(model), torch.optim.AdamW, lr=5.0)
    opt.load_state_dict(xla)
    assert opt.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **EXACT)  # gathered from the master shards
    _full_step(ref, ref_opt, 2, max_norm=1.0)
    _local_step(model, opt, 2)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def _adamw_fp32_inside_zero1() -> None:
    """NxD's examples: NeuronZero1Optimizer(groups, AdamW_FP32OptimParams, ...) vs the same
    optimizer in one process (clipped to 1.0 like ZeRO-1's default)."""
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = AdamW_FP32OptimParams(_groups(ref), lr=1e-2)
    opt = NeuronZero1Optimizer(_groups(model), AdamW_FP32OptimParams, lr=1e-2, pin_layout=False)
    assert isinstance(opt.base_optimizer, AdamW_FP32OptimParams)
    for step in range(4):
        _full_step(ref, ref_opt, step, max_norm=1.0)
        _local_step(model, opt, step)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL)


def _suite() -> None:
    nxd_state.initialize_model_parallel()
    _nxd_test_pattern()
    _attributes()
    _lazy_init_and_flags()
    _reductions_and_caps()
    _torch_xla_state_dict()
    _adamw_fp32_inside_zero1()


def test_torch_xla_surface_at_dp2() -> None:
    run_distributed(_suite, 2)
