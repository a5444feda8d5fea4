"""bf16 params with fp32 master weights track an fp32 reference; pure bf16 does not.

DP=2, two micro-batches per step, AdamW at lr 1e-3 for 5 steps, starting from weights that are
exactly representable in bf16 (so both runs start equal). Tolerance, documented:

* fp32 master weights vs the reference: atol 5e-4. The bf16 forward/backward perturbs each
  gradient by ~2^-8 relative; Adam's update is at most lr = 1e-3 per element per step and the
  perturbation changes its direction by a small fraction of that: 5 steps x lr x 10% = 5e-4
  (measured: ~1.6e-4).
* bf16 params: the masters rounded to bf16, so additionally rtol 2^-8 (one bf16 ulp).

Without master weights the updates (~lr = 1e-3) are below half an ulp of many bf16 weights and
are rounded away: the same tolerance fails, which shows the comparison can tell them apart.
"""

from __future__ import annotations

import copy
import tempfile

import torch
from torch import nn

import nxd_state
from nxd_optim import MixedPrecisionConfig, NxDOptimizer, OptimizerConfig
from nxd_state.testing import run_distributed

STEPS = 5
MASTER_TOL = {"rtol": 0.0, "atol": 5e-4}
BF16_TOL = {"rtol": 2**-8, "atol": 5e-4}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))
    with torch.no_grad():  # start from bf16-representable weights: both runs start equal
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)


def _train_step(model: nn.Module, opt: NxDOptimizer, step: int, fp32_acc: bool) -> None:
    state = nxd_state.get_parallel_state()
    x, y = _batch(step)
    local_x = x.chunk(state.data_parallel_size)[state.data_parallel_rank]
    local_y = y.chunk(state.data_parallel_size)[state.data_parallel_rank]
    opt.zero_grad()
    for mx, my in zip(local_x.chunk(2), local_y.chunk(2)):
        (nn.functional.mse_loss(model(mx.bfloat16()).float(), my) / 2).backward()
        if fp32_acc:  # accumulated into fp32 buffers, the bf16 grads freed
            assert all(p.grad is None for p in model.parameters())
    opt.step()


def _run(zero: bool, masters: bool, fp32_acc: bool) -> tuple[nn.Module, nn.Module, NxDOptimizer]:
    ref = _model()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    config = OptimizerConfig(zero_one_enabled=zero, grad_clipping=False)
    mixed = MixedPrecisionConfig(
        use_master_weights=masters, use_fp32_grad_acc=fp32_acc, use_master_weights_in_ckpt=masters
    )
    opt = NxDOptimizer(
        model.parameters(), torch.optim.AdamW, config=config, mixed_precision=mixed, lr=1e-3
    )
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        _train_step(model, opt, step, fp32_acc)
    return ref, model, opt


def _resumes_exactly(model: nn.Module, opt: NxDOptimizer, fp32_acc: bool, directory: str) -> None:
    """Master weights in the checkpoint: a fresh model + optimizer restored from a sharded
    save, or from an in-memory state dict, reproduce the next step bit for bit."""
    opt.save_sharded_state_dict(directory)
    snapshot = copy.deepcopy(opt.state_dict())
    assert "master_weights" in snapshot
    weights = copy.deepcopy(model.state_dict())
    _train_step(model, opt, STEPS, fp32_acc)
    for restore in ("sharded", "state_dict"):
        resumed = _model().to(torch.bfloat16)
        resumed.load_state_dict(weights)
        opt2 = NxDOptimizer(
            resumed.parameters(),
            torch.optim.AdamW,
            config=opt.config,
            mixed_precision=opt.mixed_precision,
            lr=1e-3,
        )
        if restore == "sharded":
            opt2.load_sharded_state_dict(directory)
        else:
            opt2.load_state_dict(snapshot)
        _train_step(resumed, opt2, STEPS, fp32_acc)
        for p, q in zip(resumed.parameters(), model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)  # same ops, same order: exact


def _suite(directory: str) -> list[float]:
    nxd_state.initialize_model_parallel()
    # Without ZeRO-1 the fp32 masters are what the wrapped optimizer steps.
    ref, model, opt = _run(zero=False, masters=True, fp32_acc=False)
    for p_ref, master, p in zip(
        ref.parameters(), opt.param_groups[0]["params"], model.parameters()
    ):
        assert master.dtype == torch.float32
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(master, p_ref.detach(), **MASTER_TOL)
        torch.testing.assert_close(p, master.to(torch.bfloat16), rtol=0, atol=0)
    # The public accessor: {model param: the master the wrapped optimizer steps}, in order.
    by_param = opt.master_weights_by_param()
    assert [id(p) for p in by_param] == [id(p) for p in model.parameters()]
    assert [id(m) for m in by_param.values()] == [id(m) for m in opt.param_groups[0]["params"]]
    by_param.clear()  # a new dict per call: the wrapper's own mapping is untouched
    assert len(opt.master_weights_by_param()) == len(list(model.parameters()))
    _resumes_exactly(model, opt, False, f"{directory}/plain")
    # ZeRO-1 with fp32 accumulation: fp32 master shards, bf16 params gathered.
    ref, model, opt = _run(zero=True, masters=True, fp32_acc=True)
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p.float(), p_ref.detach(), **BF16_TOL)
    assert opt.master_weights_by_param() == {}  # ZeRO-1's masters are its flat shards
    assert all(b.master.dtype == torch.float32 for b in opt.optimizer.dtype_buckets)
    _resumes_exactly(model, opt, True, f"{directory}/zero1")
    # Pure bf16 (no masters), plain and ZeRO-1: the reference is out of reach.
    errors = []
    for zero in (False, True):
        ref, model, opt = _run(zero=zero, masters=False, fp32_acc=False)
        assert opt.master_weights_by_param() == {}
        within = all(  # the same test as assert_close: |p - p_ref| <= atol + rtol |p_ref|
            torch.allclose(p.float(), p_ref.detach(), **BF16_TOL)
            for p_ref, p in zip(ref.parameters(), model.parameters())
        )
        assert not within, "pure bf16 should not meet the master-weight tolerance"
        errors.append(
            max(
                float((p.float() - q).abs().max())
                for p, q in zip(model.parameters(), ref.parameters())
            )
        )
    return errors


def test_bf16_with_fp32_master_weights_tracks_fp32_reference() -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_suite, 2, directory)
    assert all(error > MASTER_TOL["atol"] for error in results[0])


def test_fp32_accumulation_buffers_only_low_precision_params() -> None:
    """With fp32 accumulation, a bf16 parameter's micro-batch gradients are summed in an fp32
    buffer; an fp32 parameter keeps summing in its own ``p.grad`` (no second fp32 copy), with
    the same sums: G = g1 + g2 exactly (both sides add the same two fp32 tensors)."""
    from nxd_optim._mixed_precision import GradientStore

    full = torch.nn.Parameter(torch.randn(4, 3))
    half = torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16))
    store = GradientStore([full, half], fp32_accumulation=True)
    xs = [torch.randn(3), torch.randn(3)]
    for x in xs:
        ((full @ x).sum() + (half.float() @ x).sum() ** 2).backward()
    grads = store.grads([full, half])
    assert grads[0] is full.grad  # the parameter's own gradient, not a buffer
    assert grads[1].dtype == torch.float32
    assert half.grad is None  # moved into the buffer after each backward
    expected_full = sum(torch.ones(4, 1) * x for x in xs)
    torch.testing.assert_close(grads[0], expected_full, rtol=0, atol=0)
    expected_half = sum(
        (2 * (half.detach().float() @ x).sum() * torch.ones(4, 1) * x).to(torch.bfloat16).float()
        for x in xs
    )
    torch.testing.assert_close(grads[1], expected_half, rtol=0, atol=0)
    store.zero([full, half])
    assert full.grad is None
    assert torch.count_nonzero(store.grads([half])[0]) == 0
