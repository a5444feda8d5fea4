"""pad_model against the unpadded model in one process, on 2 and 4 gloo ranks: NxD's
per-rank layout (each shard followed by its zeros) and ``head_aligned=True`` (whole zero
heads), outputs and input gradients unchanged where the layout promises it; every padded
parameter marked with the ``TensorParallelPadding`` that undoes its padding.

Tolerances (``_models.py``): fp32 with torch's defaults for Column -> GeLU -> Row (the same
products, zero columns added), rtol=atol=1e-5 through attention; EXACT for copied weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelPadding,
    divide,
    full_tensor,
    get_number_of_extra_heads,
    pad_model,
)
from nxd_state.testing import load_sibling, run_distributed, run_named_checks

M = load_sibling(__file__, "_models")
FP32, BLOCK, EXACT, B, S = M.FP32, M.BLOCK, M.EXACT, M.B, M.S  # tolerances: see _models.py


class PaddableAttention(nn.Module):
    """Multi-head attention written for pad_model: local heads from the padded count."""

    def __init__(self, hidden: int, n_heads: int, hd: int) -> None:
        super().__init__()
        tp, _ = M.tp_rank()
        self.hd = hd
        self.n_heads_local = divide(n_heads + get_number_of_extra_heads(n_heads, tp), tp)
        self.q = ColumnParallelLinear(hidden, n_heads * hd, bias=False, gather_output=False)
        self.k = ColumnParallelLinear(hidden, n_heads * hd, bias=False, gather_output=False)
        self.v = ColumnParallelLinear(hidden, n_heads * hd, bias=False, gather_output=False)
        self.o = RowParallelLinear(n_heads * hd, hidden, bias=False, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        assert q.shape[-1] == self.n_heads_local * self.hd, "pad_model was not applied"
        return self.o(M.attend(q, k, v, self.hd, seq_first=False))


class TwoBlocks(nn.Module):
    def __init__(self, attention: nn.Module, mlp_up: nn.Module, mlp_down: nn.Module) -> None:
        super().__init__()
        self.attention, self.up, self.down = attention, mlp_up, mlp_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.down(F.gelu(self.up(x)))


def _attention_model(hidden: int, n_heads: int, hd: int) -> tuple[nn.Module, TwoBlocks]:
    """A reference attention + MLP and the parallel copy holding its weights."""
    tp, rank = M.tp_rank()
    ref_attn = M.RefAttention(hidden, n_heads, n_heads, hd)
    ref = TwoBlocks(ref_attn, nn.Linear(hidden, 32), nn.Linear(32, hidden))
    par_attn = PaddableAttention(hidden, n_heads, hd)
    par = TwoBlocks(
        par_attn,
        ColumnParallelLinear(hidden, 32, gather_output=False),
        RowParallelLinear(32, hidden, input_is_parallel=True),
    )
    with torch.no_grad():
        for name in "qkv":
            getattr(par_attn, name).weight.copy_(getattr(ref_attn, name).weight.chunk(tp)[rank])
        par_attn.o.weight.copy_(ref_attn.o.weight.chunk(tp, dim=1)[rank])
        for mod_par, mod_ref, dim in ((par.up, ref.up, 0), (par.down, ref.down, 1)):
            mod_par.weight.copy_(mod_ref.weight.chunk(tp, dim=dim)[rank])
            mod_par.bias.copy_(mod_ref.bias.chunk(tp)[rank] if dim == 0 else mod_ref.bias)
    return ref, par


def _reference_output(ref: TwoBlocks, x: torch.Tensor, hd: int) -> torch.Tensor:
    attn = ref.attention  # the reference attention without its norm
    h = x + attn.o(M.attend(attn.q(x), attn.k(x), attn.v(x), hd, False))
    return h + ref.down(F.gelu(ref.up(h)))


def check_pad_model_head_aligned() -> None:
    """3 heads over TP 2 or 4, head_aligned=True: 4 whole heads, the attention unchanged.
    NxD's pad_hook_fn semantics: called on every module of the padded region."""
    tp, _ = M.tp_rank()
    hidden, n_heads, hd = 16, 3, 4
    ref, par = _attention_model(hidden, n_heads, hd)
    unpadded = {n: full_tensor(getattr(par.attention, n).weight) for n in "qkvo"}
    seen: list[tuple[str, float]] = []
    pad_model(
        par,
        tp,
        n_heads,
        wrapped_classes=(PaddableAttention,),
        pad_hook_fn=lambda m, ratio: seen.append((type(m).__name__, ratio)),
        head_aligned=True,
    )
    linears = ["ColumnParallelLinear"] * 3 + ["RowParallelLinear"]
    assert seen == [(name, 4 / 3) for name in [*linears, "PaddableAttention"]]
    assert par.attention.q.output_size == 4 * hd
    assert par.up.output_size == 32  # outside wrapped_classes: untouched
    # The marks: which dim grew from which size, in which layout; unpad() gives the original.
    for name in "qkvo":
        weight = getattr(par.attention, name).weight
        padding = weight.tensor_parallel_padding
        dim = 1 if name == "o" else 0
        assert padding == TensorParallelPadding(dim, 3 * hd, 4 * hd, "head_aligned", tp)
        torch.testing.assert_close(padding.unpad(full_tensor(weight)), unpadded[name], **EXACT)
    assert not hasattr(par.up.weight, "tensor_parallel_padding")
    x = torch.randn(B, S, hidden)
    torch.testing.assert_close(par(x), _reference_output(ref, x, hd), **BLOCK)
    # NxD's per-rank layout splits heads here (a rank's original shard is 1.5 or 0.75 heads),
    # so the same attention padded that way computes something else: why head_aligned exists.
    ref2, nxd_padded = _attention_model(hidden, n_heads, hd)
    pad_model(nxd_padded, tp, n_heads, wrapped_classes=(PaddableAttention,))
    assert not torch.allclose(nxd_padded(x), _reference_output(ref2, x, hd), **BLOCK)
    M.raises(lambda: pad_model(par, tp + 1, n_heads), f"tp_degree({tp + 1})")
    M.raises(lambda: TensorParallelPadding(0, 3, 4, "middle", 2), "'middle'")
    M.raises(lambda: TensorParallelPadding(0, 3, 4, "per_rank", 2), "tp_size(2)")


def check_pad_model_nxd_layout() -> None:
    """NxD's layout: every rank zero-pads its own shard (so per-rank state dicts are NxD's);
    a Column -> GeLU -> Row block computes what it did before, outputs and input gradients;
    n_heads=1 is NxD's own test (each shard grows tp times)."""
    tp, rank = M.tp_rank()
    hidden, width = 16, 12
    for n_heads in (3, 1):
        n_padded = n_heads + get_number_of_extra_heads(n_heads, tp)
        local, new_local = width // tp, width // tp * n_padded // n_heads
        up = ColumnParallelLinear(hidden, width, gather_output=False)
        down = RowParallelLinear(width, hidden, input_is_parallel=True)
        gathered = ColumnParallelLinear(hidden, width, gather_output=True)
        model = nn.ModuleDict({"up": up, "down": down, "gathered": gathered})
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        full_before = {k: full_tensor(v) for k, v in model.named_parameters()}
        x = torch.randn(B, S, hidden)
        x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, g_out_ref = down(F.gelu(up(x_ref))), gathered(x)
        pad_model(model, tp, n_heads)
        after = model.state_dict()
        assert after["up.weight"].shape == (new_local, hidden)
        assert after["down.weight"].shape == (hidden, new_local)
        torch.testing.assert_close(after["up.weight"][:local], before["up.weight"], **EXACT)
        torch.testing.assert_close(after["up.bias"][:local], before["up.bias"], **EXACT)
        torch.testing.assert_close(after["down.weight"][:, :local], before["down.weight"], **EXACT)
        assert torch.count_nonzero(after["up.weight"][local:]) == 0
        assert torch.count_nonzero(after["down.weight"][:, local:]) == 0
        torch.testing.assert_close(after["down.bias"], before["down.bias"], **EXACT)
        assert (up.output_size, down.input_size) == (new_local * tp, new_local * tp)
        # The full tensor interleaves each rank's rows with its zeros: [W_0; 0; W_1; 0; ...].
        full = full_tensor(up.weight).reshape(tp, new_local, hidden)
        torch.testing.assert_close(full[rank, :local], before["up.weight"], **EXACT)
        out = down(F.gelu(up(x_par)))
        torch.testing.assert_close(out, out_ref, **FP32)
        g = torch.randn_like(out)
        (out_ref * g).sum().backward()
        (out * g).sum().backward()
        torch.testing.assert_close(x_par.grad, x_ref.grad, **FP32)
        # A gathered Column: its full bias follows the gathered, per-rank-padded layout.
        g_out = gathered(x).reshape(B, S, tp, new_local)
        torch.testing.assert_close(g_out[..., :local], g_out_ref.reshape(B, S, tp, local), **FP32)
        assert torch.count_nonzero(g_out[..., local:]) == 0
        assert after["gathered.bias"].shape == (new_local * tp,)
        # The marks (the gathered Column's replicated bias included) describe this layout:
        # unpad() of the full padded tensor is the full tensor before padding, bit for bit.
        for name, param in model.named_parameters():
            if name == "down.bias":  # a Row's bias is not padded
                assert not hasattr(param, "tensor_parallel_padding")
                continue
            padding = param.tensor_parallel_padding
            dim = 1 if name == "down.weight" else 0
            assert padding == TensorParallelPadding(dim, width, new_local * tp, "per_rank", tp)
            restored = padding.unpad(full_tensor(param))
            torch.testing.assert_close(restored, full_before[name], **EXACT, msg=name)
        twin = copy.deepcopy(model)  # the marks survive a copy, and JSON
        assert twin.up.weight.tensor_parallel_padding == up.weight.tensor_parallel_padding
        mark = up.weight.tensor_parallel_padding
        assert TensorParallelPadding.from_dict(mark.to_dict()) == mark


CHECKS: dict[str, Callable[[], None]] = {
    "pad_model_head_aligned": check_pad_model_head_aligned,
    "pad_model_nxd_layout": check_pad_model_nxd_layout,
}


def run_checks(tp: int) -> list[str]:
    """Every check on this rank, in order (see ``run_named_checks``)."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return run_named_checks(CHECKS, seed=206, context=f"tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_pad_model_matches_one_process(tp: int) -> None:
    """Every check of CHECKS on ``tp`` ranks (one spawn); a failure names its check."""
    assert run_distributed(run_checks, tp, tp) == [list(CHECKS)] * tp
