"""NxDOptimizer's flat fp32 masters (no ZeRO-1) step bit for bit like per-param masters.

The reference is written here from the wrapper's math (module docstring of ``nxd_optim.wrapper``,
at world size 1 where the DP mean is the identity): θ32 = float32(θ) per bf16 param, fp32
params stepped in place; with fp32 accumulation G_p += float32(g_p) after every backward for
the bf16 params that required grad at construction, else G_p = p.grad (zeros when unused);
``scale_gradients(c)``: G_p <- c · G_p in G_p's dtype (one ``_foreach_mul_``); θ32.grad =
float32(G_p); clipping by ``nxd_layers.clip_grad_norm`` over the stepped tensors in param
order; the inner optimizer (``torch.optim``) over the same groups; θ <- round(θ32). Every
tensor is compared with ``torch.equal`` after every step: no tolerance, the two must do the
same arithmetic. (The same test passes against the per-param code this replaced.)

The model mixes bf16 and fp32 params in two groups with different learning rates, a frozen
bf16 param, an unused one (zero gradient), one frozen at construction and unfrozen at step 2
(it has no gradient view: a new fp32 gradient per step, bf16 accumulation), and one frozen at
step 2 and unfrozen at step 3; at step 1 the inner optimizer's own ``zero_grad()`` detaches
the gradient views (the step re-attaches them). AdamW (foreach) and SGD with momentum, with
and without fp32 accumulation, with and without clipping that binds, the second group given
at construction or through ``add_param_group``; 3 micro-batches and ``scale_gradients(1/3)``.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

import nxd_state
from nxd_layers import clip_grad_norm
from nxd_optim import MixedPrecisionConfig, NxDOptimizer, OptimizerConfig
from nxd_state.testing import run_distributed

STEPS = 4
MICRO_BATCHES = 3
MAX_NORM = 0.05  # the gradients' norm is ~0.3-1: clipping binds at every step (asserted)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
}


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)

        def param(*shape: int, dtype: torch.dtype = torch.bfloat16) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape).to(dtype))

        self.w1, self.b1 = param(6, 5), param(5, dtype=torch.float32)
        self.scale = param(5, dtype=torch.float32)
        self.w2, self.frozen = param(5, 3), param(3)
        self.late, self.flip, self.unused = param(5), param(5), param(4)
        self.frozen.requires_grad_(False)
        self.late.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.w1).float() + self.b1
        h = torch.tanh(h * self.scale + self.late.float() * self.flip.float())
        return (h.bfloat16() @ self.w2).float() + self.frozen.float()

    def groups(self) -> list[dict[str, Any]]:
        first = [self.w1, self.b1, self.frozen, self.late, self.unused]
        return [{"params": first, "lr": 3e-2}, {"params": [self.scale, self.w2, self.flip]}]


class _Reference:
    """Per-param fp32 masters and the inner optimizer, the wrapper's math spelled out."""

    def __init__(self, model: _Model, name: str, *, acc: bool, clip: bool) -> None:
        self.params = [p for g in model.groups() for p in g["params"]]
        bf16 = [p for p in self.params if p.dtype == torch.bfloat16]
        self.masters = {p: p.detach().clone().float() for p in bf16}
        self.buffers = {p: torch.zeros_like(p, dtype=torch.float32) for p in bf16 if acc}
        self.buffers = {p: b for p, b in self.buffers.items() if p.requires_grad}
        self.clip = clip
        cls, kwargs = OPTIMIZERS[name]
        groups = [
            {**g, "params": [self.masters.get(p, p) for p in g["params"]]} for g in model.groups()
        ]
        self.inner = cls(groups, **kwargs)
        self.norm: torch.Tensor | None = None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        for param, buffer in self.buffers.items():
            if param.grad is not None:
                buffer.add_(param.grad)
                param.grad = None

    @torch.no_grad()
    def step(self, factor: float) -> None:
        trainable = [p for p in self.params if p.requires_grad]
        grads = []
        for param in trainable:
            if param in self.buffers:
                grads.append(self.buffers[param])
            else:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
        torch._foreach_mul_(grads, factor)  # not mul_: on CPU it rounds bf16 differently
        stepped = []
        for param, grad in zip(trainable, grads):
            target = self.masters.get(param, param)
            if target is not param or grad is not param.grad:
                target.grad = grad.to(target.dtype)
            stepped.append(target)
        if self.clip:
            self.norm = clip_grad_norm(stepped, MAX_NORM, 2.0, tensor_parallel_group=None)
        self.inner.step()
        for param, master in self.masters.items():
            param.copy_(master)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
        for buffer in self.buffers.values():
            buffer.zero_()
        for master in self.masters.values():
            master.grad = None


def _optimizer(model: _Model, name: str, *, acc: bool, clip: bool, add_later: bool) -> Any:
    cls, kwargs = OPTIMIZERS[name]
    groups = model.groups()
    opt = NxDOptimizer(
        groups[:1] if add_later else groups,
        cls,
        config=OptimizerConfig(grad_clipping=clip, max_grad_norm=MAX_NORM),
        mixed_precision=MixedPrecisionConfig(
            use_master_weights=True, use_fp32_grad_acc=acc, use_master_weights_in_ckpt=True
        ),
        **kwargs,
    )
    if add_later:
        opt.add_param_group(groups[1])
    return opt


def _flip_requires_grad(models: list[_Model], step: int) -> None:
    for model in models:
        if step == 2:
            model.late.requires_grad_(True)
            model.flip.requires_grad_(False)
        if step == 3:
            model.flip.requires_grad_(True)


def _assert_same(
    model: _Model, opt: NxDOptimizer, ref_model: _Model, ref: _Reference, where: str
) -> None:
    names = [name for name, _ in model.named_parameters()]
    for name, a, b in zip(names, model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), f"{where}: param {name}"
    masters = opt.master_weights_by_param()
    assert [id(p) for p in masters] == [id(p) for p in opt._params if p in masters], where
    for (param, master), want in zip(masters.items(), ref.masters.values(), strict=True):
        assert master.dtype == torch.float32, where
        diff = (master - want).abs().max()
        assert torch.equal(master, want), f"{where}: master of shape {param.shape} off {diff}"
    got, want = opt.state_dict(), ref.inner.state_dict()
    assert got["param_groups"] == want["param_groups"], where
    assert got["state"].keys() == want["state"].keys(), where
    for key, state in want["state"].items():
        assert state.keys() == got["state"][key].keys(), where
        for field, value in state.items():
            assert torch.equal(got["state"][key][field], value), f"{where}: state {key} {field}"
    if ref.clip:
        assert opt.grad_norm is not None, where
        assert ref.norm is not None, where
        assert torch.equal(opt.grad_norm, ref.norm), where
        assert float(ref.norm) > MAX_NORM, f"{where}: clipping does not bind"


def _train_step(
    step: int, pairs: list[tuple[_Model, Any]], gen: torch.Generator, *, detach_views: bool
) -> None:
    """One step of every (model, optimizer or reference): the same batch, 3 micro-batches."""
    x = torch.randn(MICRO_BATCHES * 4, 6, generator=gen).bfloat16()
    y = torch.randn(MICRO_BATCHES * 4, 3, generator=gen)
    for model, opt in pairs:
        opt.zero_grad()
        if detach_views and isinstance(opt, NxDOptimizer):
            opt.optimizer.zero_grad()  # master.grad = None: the step must re-attach the views
        for mx, my in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
            loss = nn.functional.mse_loss(model(mx), my)
            if isinstance(opt, _Reference):
                opt.backward(loss)
            else:
                loss.backward()
        if isinstance(opt, NxDOptimizer):
            opt.scale_gradients(1 / MICRO_BATCHES)
            opt.step()
        else:
            opt.step(1 / MICRO_BATCHES)


def _case(name: str, acc: bool, clip: bool, add_later: bool) -> None:
    ref_model = _Model()
    model, resumed_model = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
    ref = _Reference(ref_model, name, acc=acc, clip=clip)
    opt = _optimizer(model, name, acc=acc, clip=clip, add_later=add_later)
    gen = torch.Generator().manual_seed(1)
    resumed: NxDOptimizer | None = None
    for step in range(STEPS):
        _flip_requires_grad([ref_model, model, resumed_model], step)
        pairs: list[tuple[_Model, Any]] = [(ref_model, ref), (model, opt)]
        if resumed is not None:
            pairs.append((resumed_model, resumed))
        _train_step(step, pairs, gen, detach_views=step == 1)
        where = f"{name} acc={acc} clip={clip} add_later={add_later} step {step}"
        _assert_same(model, opt, ref_model, ref, where)
        if resumed is not None:
            _assert_same(resumed_model, resumed, ref_model, ref, f"resumed {where}")
        if step == 1:  # a fresh optimizer loads the state and continues like this one
            resumed = _resume(opt, model, resumed_model, name, acc=acc, clip=clip)
    _check_flat(opt, acc, buffers=2 if add_later else 1)


def _resume(
    opt: NxDOptimizer, model: _Model, fresh: _Model, name: str, *, acc: bool, clip: bool
) -> NxDOptimizer:
    """state_dict -> a fresh optimizer over a copy of the params: a bitwise round trip."""
    saved = opt.state_dict()
    for tensor in saved["master_weights"]:  # standalone tensors, not views of the flat buffer
        assert tensor._base is None
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    with torch.no_grad():
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
            a.copy_(b)
    resumed = _optimizer(fresh, name, acc=acc, clip=clip, add_later=False)
    resumed.load_state_dict(copy.deepcopy(saved))
    again = resumed.state_dict()
    assert len(again["master_weights"]) == len(saved["master_weights"])
    for a, b in zip(again["master_weights"], saved["master_weights"], strict=True):
        assert torch.equal(a, b)
    for key, state in saved["state"].items():
        for field, value in state.items():
            assert torch.equal(again["state"][key][field], value)
    return resumed


def _check_flat(opt: NxDOptimizer, acc: bool, buffers: int) -> None:
    """Masters are views of one flat buffer per construction / add_param_group; so are their
    gradients, which stay put across zero_grad (no allocation at the next step)."""
    masters = list(opt.master_weights_by_param().values())
    assert all(m._base is not None for m in masters)
    assert len({id(m._base) for m in masters}) == buffers
    viewed = [m for m in masters if m.grad is not None and m.grad._base is not None]
    assert len(viewed) == len(masters) - 2  # all but frozen and late (unfrozen after)
    grads = [m.grad for m in viewed]
    pointers = [g.data_ptr() for g in grads]
    opt.zero_grad()
    assert all(m.grad is g for m, g in zip(viewed, grads, strict=True))
    assert [m.grad.data_ptr() for m in viewed] == pointers
    assert len({id(g._base) for g in grads}) == buffers
    if acc:  # the accumulation buffers are those very views, zeroed
        assert all(torch.count_nonzero(g) == 0 for g in grads)


def _all_cases() -> list[str]:
    nxd_state.initialize_model_parallel()
    done = []
    for name, acc, clip in itertools.product(OPTIMIZERS, (False, True), (True, False)):
        add_later = name == "sgd"
        _case(name, acc, clip, add_later)
        done.append(f"{name} acc={acc} clip={clip} add_later={add_later}")
    return done


def test_flat_masters_step_bitwise_like_per_param_masters() -> None:
    (done,) = run_distributed(_all_cases, 1)
    assert len(done) == 8
