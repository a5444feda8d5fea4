"""EP-aware ZeRO-1 (:class:`NeuronEPZero1Optimizer`) against one process and against the
non-ZeRO :class:`NxDOptimizer` at the same EP degree.

The model: a dense linear followed by the tiny MoE block (hidden 16, 4 experts, top-2,
dropless), float64, trained 3 steps with AdamW (weight decay) and gradient clipping at EP=2:
world 2 (expert-DP 1), world 4 (expert-DP 2; ``"auto"`` then all-reduces the expert buckets
and reduce-scatters the dense ones, and the forced ``"reduce_scatter"`` variant sums the
experts' norm pieces over DP), world 4 as DP 2 x CP 2 (expert-DP = (DP/EP) x CP = 2; the
model has no attention, so a CP rank is one more replica on its own tokens), world 4 as TP 2 x
DP 2 (the experts TP-sharded inside, expert-DP 1; the dense linear and the router replicated
over TP) and, ``-m slow``,
world 8 (expert-DP 4). Each rank feeds its own rows of the batch (its DP x CP rank order =
the one-process batch order), in two micro-batches whose summed gradients
``scale_gradients(1/2)`` turns into the mean, ZeRO-1's accumulation scaling.
Compared on every rank: every parameter after the 3 steps (experts against this rank's slice
of the one-process experts, and this TP rank's shard of each), every step's loss (averaged
over DP x CP) and clipped gradient norm; and every parameter against ``NxDOptimizer``
without ZeRO-1 at the same EP.

Tolerance: float64 everywhere; the parallel run computes the same products, summed in another
order (the all-to-all regroups tokens, gradients are reduce-scattered or all-reduced), so
losses and gradients agree to a few ulps of float64 (1e-10 for the losses is far above that).
The clipping factor carries float32 rounding: ``get_grad_norm`` returns a float32 norm (its
documented accumulator), ~6e-8 relative, which the one-process ``clip_grad_norm_`` (float64)
does not; it reaches the parameters through the AdamW updates (through ε and the moments'
mix of steps), measured after 3 steps at up to 2e-8 absolute (4e-7 relative, at elements
near zero). rtol 1e-6 / atol 1e-8 for the parameters (and rtol 1e-6 for the float32 norms)
covers that with a margin of ~5x and stays far below a real mistake: expert gradients at the
wrong scale (the mean over expert-DP, EP times too large: 1.7e-5 absolute, 2e-3 relative,
the control below), experts sharded and averaged over DP x CP, or an expert norm counted once
per expert-DP replica each fail this comparison (checked by editing the optimizer).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nxd_state as ps
from nxd_layers.moe import ExpertMLPsCapacityFactor, MoE, RouterTopK
from nxd_optim import NeuronEPZero1Optimizer, NeuronZero1Optimizer, NxDOptimizer, OptimizerConfig
from nxd_state import collectives
from nxd_state.testing import run_distributed

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 16, 4, 2, 8
ROWS_PER_RANK, SEQ, STEPS, MICRO = 2, 3, 3, 2
EP = 2
MAX_NORM = 0.005  # below every step's gradient norm: clipping binds (asserted)
HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
LOSS_TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64, reordered sums (module docstring)
PARAM_TOL = {"rtol": 1e-6, "atol": 1e-8}  # float32 clip factor (module docstring)
NORM_TOL = {"rtol": 1e-6, "atol": 0.0}  # float32 norm against the float64 one

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class DenseThenMoE(nn.Module):
    """x -> Linear(16, 16) -> MoE (top-2 of 4 gated-SiLU experts, dropless)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same full weights at any EP degree (experts drawn full)
        self.dense = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        router = RouterTopK(EXPERTS, TOP_K, HIDDEN, dtype=torch.float64)
        experts = ExpertMLPsCapacityFactor(
            EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", None, True, dtype=torch.float64
        )
        self.moe = MoE(router, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe(self.dense(x))[0]
        return out


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups, each mixing dense and expert params: biases without weight decay."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _batches(world: int, steps: int = STEPS) -> Batches:
    gen = torch.Generator().manual_seed(11)
    shape = (world * ROWS_PER_RANK, SEQ, HIDDEN)
    return [
        (
            torch.randn(shape, dtype=torch.float64, generator=gen),
            torch.randn(shape, dtype=torch.float64, generator=gen),
        )
        for _ in range(steps)
    ]


def _train(
    model: nn.Module,
    optimizer: Any,
    batches: Batches,
    rows: slice,
    *,
    micro: int = 1,
    clip: Callable[[], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Steps of mean-squared error on ``rows`` of each batch, in ``micro`` micro-batches
    (their summed gradients scaled by 1/micro); the losses and the gradient norms (``clip()``'s,
    else the optimizer's)."""
    losses, norms = [], []
    for x, target in batches:
        optimizer.zero_grad()
        xs, ts = x[rows].chunk(micro), target[rows].chunk(micro)
        total = torch.zeros((), dtype=torch.float64)
        for xm, tm in zip(xs, ts, strict=True):
            loss = ((model(xm) - tm) ** 2).mean()
            loss.backward()
            total += loss.detach()
        if micro > 1:
            optimizer.scale_gradients(1.0 / micro)
        norm = clip() if clip is not None else None
        optimizer.step()
        norms.append(norm if norm is not None else optimizer.grad_norm)
        losses.append(total / micro)
    return losses, norms


def _reference(batches: Batches) -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]:
    """One process, every expert, the whole batch, torch's AdamW and clip_grad_norm_."""
    ref = DenseThenMoE()
    opt = torch.optim.AdamW(_param_groups(ref), **HYPER)
    params = list(ref.parameters())
    losses, norms = _train(
        ref,
        opt,
        batches,
        slice(None),
        clip=lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM),
    )
    assert all(float(n) > MAX_NORM for n in norms)  # clipping really scales
    return ref, losses, norms


def _my_rows() -> slice:
    """This rank's rows: its position in the DP x CP group (the model has no attention, so a
    context-parallel rank is one more replica feeding its own tokens)."""
    state = ps.get_parallel_state()
    rank = state.data_context_parallel_ranks.index(state.rank)
    return slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)


def _tp_slices() -> dict[str, tuple[int, torch.Tensor]]:
    """Per expert weight, (dim, indices) of this TP rank's shard: TP rank t holds intermediate
    columns t of the gate and of the up projection, rows t of the down projection."""
    tp = ps.get_tensor_model_parallel_size()
    t, width = ps.get_tensor_model_parallel_rank(), INTERMEDIATE // tp
    inner = torch.arange(t * width, (t + 1) * width)
    return {
        "moe.expert_mlps.gate_up_proj.weight": (2, torch.cat([inner, inner + INTERMEDIATE])),
        "moe.expert_mlps.down_proj.weight": (1, inner),
    }


def _assert_params(model: nn.Module, reference: nn.Module, what: str, **tol: float) -> None:
    """Every param equals the one-process one (experts: this EP rank's experts, this TP
    rank's shard of each)."""
    ep_rank = ps.get_expert_model_parallel_rank()
    local = EXPERTS // ps.get_expert_model_parallel_size()
    mine = slice(ep_rank * local, (ep_rank + 1) * local)
    tp_slices = _tp_slices()
    expected_by_name = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = expected_by_name[name]
        if getattr(param, "expert_model_parallel", False):
            expected = expected[mine]
        if name in tp_slices:
            dim, index = tp_slices[name]
            expected = expected.index_select(dim, index)
        torch.testing.assert_close(param, expected, **tol, msg=lambda m, n=name: f"{what} {n}: {m}")


def _ep_zero1(model: nn.Module, grad_reduction: str) -> NeuronEPZero1Optimizer:
    return NeuronEPZero1Optimizer(
        _param_groups(model),
        torch.optim.AdamW,
        max_norm=MAX_NORM,
        sharding_groups=ps.get_parallel_state().layout.data_context_parallel_groups(),
        grad_reduction=grad_reduction,
        use_grad_acc_hook=True,  # accumulate micro-batches in the optimizer dtype (float64)
        **HYPER,
    )


def ep_zero1_parity(world: int, grad_reduction: str, cp: int, tp: int) -> None:
    """Runs on each of ``world`` ranks (EP = 2, DP x CP = world / TP); asserts parity."""
    replicas = world // tp
    batches = _batches(replicas)
    ref, ref_losses, ref_norms = _reference(batches)

    ps.initialize_model_parallel(
        expert_model_parallel_size=EP, context_parallel_size=cp, tensor_model_parallel_size=tp
    )
    # 1. The class itself, micro-batches scaled by scale_gradients.
    model = DenseThenMoE()
    opt = _ep_zero1(model, grad_reduction)
    assert opt.ep_zero_optimizer is not None
    assert opt.non_ep_zero_optimizer is not None
    assert opt.ep_zero_optimizer.sharding_size == replicas // EP  # expert-DP
    assert opt.non_ep_zero_optimizer.sharding_size == replicas  # DP x CP
    losses, norms = _train(model, opt, batches, _my_rows(), micro=MICRO)
    dp_group = ps.get_parallel_state().data_context_parallel_group
    for step, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
        mean = collectives.all_reduce(loss.clone(), dp_group) / replicas  # equal-sized slices
        torch.testing.assert_close(mean, ref_losses[step], **LOSS_TOL)
        assert norm is not None
        torch.testing.assert_close(norm, ref_norms[step].to(torch.float32), **NORM_TOL)
    _assert_params(model, ref, "EP ZeRO-1 vs one process", **PARAM_TOL)

    # 2. NxD's config path: NxDOptimizer(zero_one_enabled=True) at EP > 1, whole micro-batch.
    zero_model, plain_model = DenseThenMoE(), DenseThenMoE()
    config = OptimizerConfig(zero_one_enabled=True, grad_clipping=True, max_grad_norm=MAX_NORM)
    zero_opt = NxDOptimizer(_param_groups(zero_model), torch.optim.AdamW, config=config, **HYPER)
    assert isinstance(zero_opt.optimizer, NeuronEPZero1Optimizer)
    plain_config = OptimizerConfig(grad_clipping=True, max_grad_norm=MAX_NORM)
    plain_opt = NxDOptimizer(
        _param_groups(plain_model), torch.optim.AdamW, config=plain_config, **HYPER
    )
    _, zero_norms = _train(zero_model, zero_opt, batches, _my_rows())
    _, plain_norms = _train(plain_model, plain_opt, batches, _my_rows())
    for zero_norm, plain_norm in zip(zero_norms, plain_norms, strict=True):
        torch.testing.assert_close(zero_norm, plain_norm, **NORM_TOL)
    _assert_params(zero_model, ref, "NxDOptimizer ZeRO-1 EP vs one process", **PARAM_TOL)
    for (name, zero_param), plain_param in zip(
        zero_model.named_parameters(), plain_model.parameters(), strict=True
    ):  # the same local experts on both: compared whole
        torch.testing.assert_close(
            zero_param, plain_param, **PARAM_TOL, msg=lambda m, n=name: f"ZeRO-1 vs plain {n}: {m}"
        )
    ps.destroy_model_parallel()


@pytest.mark.parametrize(
    ("world", "grad_reduction", "cp", "tp"),
    [
        (2, "auto", 1, 1),
        (4, "auto", 1, 1),
        (4, "reduce_scatter", 1, 1),
        (4, "reduce_scatter", 2, 1),  # DP 2 x CP 2: expert-DP = (DP/EP) x CP = 2
        (4, "reduce_scatter", 1, 2),  # TP 2 inside the experts x DP 2: expert-DP 1
        pytest.param(8, "auto", 1, 1, marks=pytest.mark.slow),
    ],
)
def test_ep_zero1_equals_one_process_and_plain_ep(
    world: int, grad_reduction: str, cp: int, tp: int
) -> None:
    run_distributed(ep_zero1_parity, world, world, grad_reduction, cp, tp)


def wrong_scale_is_caught(world: int) -> str:
    """The parity check against a deliberately wrong expert scale (the mean over expert-DP,
    1/m instead of 1/(DP·CP)): it must fail."""
    batches = _batches(world, steps=2)
    ref, _, _ = _reference(batches)
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    model = DenseThenMoE()
    opt = _ep_zero1(model, "auto")
    expert_half = opt.ep_zero_optimizer
    assert expert_half is not None
    original = expert_half._step_reduced

    def mean_over_expert_dp(reduced: Any, coef: Any, divisor: int) -> None:
        original(reduced, coef, expert_half.sharding_size)  # the wrong divisor

    expert_half._step_reduced = mean_over_expert_dp  # type: ignore[method-assign]
    _train(model, opt, batches, _my_rows())
    with pytest.raises(AssertionError) as caught:
        _assert_params(model, ref, "wrong scale", **PARAM_TOL)
    ps.destroy_model_parallel()
    return str(caught.value)


def test_parity_check_catches_a_wrong_expert_scale() -> None:
    messages = run_distributed(wrong_scale_is_caught, 4, 4)
    # Every rank's check failed, far outside the tolerance (the wrong expert step changes the
    # next forward, so the dense params move too: the first param named is dense.weight).
    assert len(messages) == 4
    assert all("Tensor-likes are not close" in m for m in messages)


def zero1_refusals() -> list[str]:
    """Plain ZeRO-1 over expert params at EP > 1 is refused; over dense params only it is
    fine; custom sharding groups are refused by the EP-aware one."""
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    model = DenseThenMoE()
    messages = []
    with pytest.raises(NotImplementedError) as caught:
        NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    messages.append(str(caught.value))
    NeuronZero1Optimizer(model.dense.parameters(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="custom sharding groups") as bad_groups:
        NeuronEPZero1Optimizer(
            model.parameters(), torch.optim.AdamW, sharding_groups=[[0], [1]], lr=1e-2
        )
    messages.append(str(bad_groups.value))
    ps.destroy_model_parallel()
    return messages


def test_refusals() -> None:
    plain, groups = run_distributed(zero1_refusals, 2)[0]
    assert "expert_model_parallel_size=2" in plain
    assert "NeuronEPZero1Optimizer" in plain
    assert "[[0], [1]]" in groups
    assert "data x context parallel groups [[0, 1]]" in groups


def ep_zero1_round_trip(world: int, directory: str) -> None:
    """Step, save (state_dict in memory and sharded files), step on; a fresh model and
    optimizer load both ways and step: bit-identical to the run that went on."""
    first, second = _batches(world, steps=2)
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    config = OptimizerConfig(zero_one_enabled=True, grad_clipping=True, max_grad_norm=MAX_NORM)

    def build() -> tuple[nn.Module, NxDOptimizer]:
        model = DenseThenMoE()
        opt = NxDOptimizer(_param_groups(model), torch.optim.AdamW, config=config, **HYPER)
        return model, opt

    model, opt = build()
    _train(model, opt, [first], _my_rows())
    for group in opt.param_groups:
        group["lr"] = 5e-3  # as an LR scheduler would: must survive the round trip
    saved = copy.deepcopy(opt.state_dict())  # torch's state dicts alias the live state
    opt.save_sharded_state_dict(directory)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, [second], _my_rows())

    for load in ("state_dict", "sharded"):
        resumed, resumed_opt = build()
        resumed.load_state_dict(weights)
        if load == "state_dict":
            resumed_opt.load_state_dict(saved)
        else:
            resumed_opt.load_sharded_state_dict(directory)
        assert [g["lr"] for g in resumed_opt.param_groups] == [5e-3, 5e-3]
        _train(resumed, resumed_opt, [second], _my_rows())
        for (name, param), other in zip(
            model.named_parameters(), resumed.parameters(), strict=True
        ):
            torch.testing.assert_close(
                other, param, rtol=0, atol=0, msg=lambda m, n=name, w=load: f"{w} {n}: {m}"
            )
    # Another EP rank's state (different experts, same shapes) is refused, not loaded.
    other = dict(saved, expert_parallel={**saved["expert_parallel"]})
    other["expert_parallel"]["expert_model_parallel_rank"] = 1 - ps.get_expert_model_parallel_rank()
    with pytest.raises(ValueError, match="expert_model_parallel_rank"):
        build()[1].load_state_dict(other)
    ps.destroy_model_parallel()


def test_ep_zero1_state_round_trip(tmp_path: object) -> None:
    run_distributed(ep_zero1_round_trip, 4, 4, str(tmp_path))


def measure_only(world: int) -> None:
    """``max_norm=inf``: the norm is measured (the one-process one) and nothing is scaled;
    built with ``lazy_init=True``."""
    batches = _batches(world, steps=1)
    ref = DenseThenMoE()
    ref_opt = torch.optim.AdamW(_param_groups(ref), **HYPER)
    params = list(ref.parameters())
    _, ref_norms = _train(
        ref,
        ref_opt,
        batches,
        slice(None),
        clip=lambda: torch.nn.utils.clip_grad_norm_(params, math.inf, norm_type=2.0),
    )
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    model = DenseThenMoE()
    opt = NeuronEPZero1Optimizer(
        _param_groups(model), torch.optim.AdamW, max_norm=math.inf, lazy_init=True, **HYPER
    )
    assert not opt.inited  # the halves are built at init_zero()
    assert opt.ep_zero_optimizer is None
    opt.init_zero()
    _, norms = _train(model, opt, batches, _my_rows())
    torch.testing.assert_close(norms[0], ref_norms[0].to(torch.float32), **NORM_TOL)
    _assert_params(model, ref, "unclipped", **PARAM_TOL)
    ps.destroy_model_parallel()


def test_ep_zero1_measure_only() -> None:
    run_distributed(measure_only, 4, 4)


def ep1_is_plain_zero1() -> None:
    """At EP = 1 every param goes to the dense half: the steps equal plain ZeRO-1's bit for
    bit and the one-layout attributes are that half's. At EP = 2 they name both halves."""
    batches = _batches(2, steps=2)
    ps.initialize_model_parallel()
    plain_model, ep_model = DenseThenMoE(), DenseThenMoE()
    plain = NeuronZero1Optimizer(
        _param_groups(plain_model), torch.optim.AdamW, max_norm=MAX_NORM, **HYPER
    )
    ep = NeuronEPZero1Optimizer(
        _param_groups(ep_model), torch.optim.AdamW, max_norm=MAX_NORM, **HYPER
    )
    assert ep.ep_zero_optimizer is None
    assert ep.non_ep_zero_optimizer is not None
    assert ep.sharding_size == plain.sharding_size == 2
    assert len(ep.dtype_buckets) == len(plain.dtype_buckets)
    _train(plain_model, plain, batches, _my_rows())
    _train(ep_model, ep, batches, _my_rows())
    for (name, a), b in zip(plain_model.named_parameters(), ep_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    two = NeuronEPZero1Optimizer(DenseThenMoE().parameters(), torch.optim.AdamW, **HYPER)
    for name in ("sharding_size", "dtype_buckets", "base_optimizer"):
        with pytest.raises(RuntimeError, match=r"non_ep_zero_optimizer.* and ep_zero_optimizer"):
            getattr(two, name)
    ps.destroy_model_parallel()


def test_ep1_is_plain_zero1() -> None:
    run_distributed(ep1_is_plain_zero1, 2)
