"""The split backward (I then W) gives the gradients of one full backward (B), one process."""

from __future__ import annotations

import copy

import pytest
import torch

from nxd_pipeline import _backward as split
from nxd_pipeline import backward_full, backward_input, backward_weight
from nxd_pipeline.testing import TinyGPT

# fp32, same ops in another grouping: W's linear GEMM dYᵀX and layer-norm kernel are the
# engine's, so round-off only.
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("first_stage", [False, True])
def test_input_then_weight_pass_equals_full_backward(bias: bool, first_stage: bool) -> None:
    torch.manual_seed(0)
    model = TinyGPT(layers=2, hidden=32)
    if not bias:  # mm(X, Wᵀ) instead of addmm(b, X, Wᵀ)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.bias = None
    ids = torch.randint(0, 64, (2, 8))
    hidden = torch.randn(2, 8, 32)
    dy = torch.randn(2, 8, 32)

    def run(stage: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Stage output and its input X (none on the first stage, which embeds ids)."""
        if first_stage:
            x = stage.wte(ids) + stage.wpe(torch.arange(8))
            return [stage.h[1](stage.h[0](x))], []
        x = hidden.clone().requires_grad_(True)
        return [stage.h[1](stage.h[0](x))], [x]

    full, parts = copy.deepcopy(model), copy.deepcopy(model)
    outputs, inputs = run(full)
    full_dx = backward_full(outputs, [dy], inputs)
    outputs, inputs = run(parts)
    params = [p for p in parts.parameters() if p.requires_grad]
    dx, state = backward_input(outputs, [dy], inputs, params)
    linear = [g for g, b in state.branches if split._is_linear_branch(g, b)]
    assert len(linear) == 12  # 6 linear layers per block, all through the direct GEMM
    norms = [g for g, b in state.branches if split._is_layer_norm_branch(g, b)]
    assert len(norms) == 4  # ln_1 and ln_2 per block: γ and β from the norm's kernel
    assert all(len(group) == 2 for group in norms)
    for x_grad, expected in zip(dx, full_dx):
        torch.testing.assert_close(x_grad, expected, **TOL)
    assert all(p.grad is None for group in linear + norms for p in group)  # deferred to W
    backward_weight(state)
    expected = dict(full.named_parameters())
    for name, param in parts.named_parameters():
        if expected[name].grad is None:
            assert param.grad is None, name
            continue
        torch.testing.assert_close(param.grad, expected[name].grad, **TOL, msg=name)


@pytest.mark.parametrize("hooked", [False, True])
def test_weight_pass_accumulates_like_autograd(
    hooked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three microbatches: W of the later ones adds the linear gradients into ``.grad`` in
    place (``addmm_``) when no hook must see them, and through AccumulateGrad when a
    post-accumulate-grad hook is registered (the hook then sees every new gradient, as in
    a plain backward); either way the accumulated gradients are the full backward's."""
    torch.manual_seed(0)
    model = TinyGPT(layers=2, hidden=32)
    xs = [torch.randn(2, 8, 32) for _ in range(3)]
    dys = [torch.randn(2, 8, 32) for _ in range(3)]
    full, parts = copy.deepcopy(model), copy.deepcopy(model)
    seen: dict[str, int] = {}
    if hooked:
        for name, param in parts.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: seen.__setitem__(name, seen.get(name, 0) + 1)
            )
    in_place = 0
    original = split._add_linear_grads_in_place

    def counting(node: object, grad: torch.Tensor) -> None:
        nonlocal in_place
        in_place += 1
        original(node, grad)  # type: ignore[arg-type]

    monkeypatch.setattr(split, "_add_linear_grads_in_place", counting)
    for x0, dy in zip(xs, dys):
        x = x0.clone().requires_grad_(True)
        backward_full([full.h[1](full.h[0](x))], [dy], [x])
        x = x0.clone().requires_grad_(True)
        params = [p for p in parts.parameters() if p.requires_grad]
        _, state = backward_input([parts.h[1](parts.h[0](x))], [dy], [x], params)
        backward_weight(state)
    # 12 linear layers per microbatch; the first microbatch has no .grad to add to
    assert in_place == (0 if hooked else 2 * 12)
    if hooked:  # every block parameter's hook ran once per microbatch
        blocks = [name for name, _ in parts.named_parameters() if name.startswith("h.")]
        assert seen == dict.fromkeys(blocks, 3), seen
    expected = dict(full.named_parameters())
    for name, param in parts.named_parameters():
        if expected[name].grad is None:
            assert param.grad is None, name
            continue
        # fp32: addmm_ rounds G + dYᵀX once where AccumulateGrad rounds dYᵀX, then the sum
        torch.testing.assert_close(param.grad, expected[name].grad, **TOL, msg=name)
