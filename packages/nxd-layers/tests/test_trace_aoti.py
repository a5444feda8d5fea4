"""The optional AOTInductor route (``compiler_args={"aot_inductor": True}``) at TP=2: each
rank's exported program, collectives included, compiled ahead of time; the compiled packages
are saved next to the programs and loaded back.

Tolerances: Inductor fuses and reorders the elementwise work and the matmul epilogues, so the
compiled model differs from the eager TP model by float32 rounding: rtol=atol=1e-5 (values
O(1); a wrong shard or a missing all-reduce is O(1)). A loaded package runs the very code that
was compiled: exact. ``use_aot_inductor=False`` runs the exported programs: exact vs eager.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import nxd_state
from nxd_layers import ColumnParallelLinear, RowParallelLinear
from nxd_layers.trace import parallel_model_load, parallel_model_save, parallel_model_trace
from nxd_state.testing import run_distributed

X = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
EXACT = {"rtol": 0.0, "atol": 0.0}
COMPILED = {"rtol": 1e-5, "atol": 1e-5}  # see the module docstring


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = ColumnParallelLinear(16, 64, bias=False, gather_output=False)
        self.up = ColumnParallelLinear(16, 64, bias=False, gather_output=False)
        self.down = RowParallelLinear(64, 16, bias=False, input_is_parallel=True)
        self.head = ColumnParallelLinear(16, 32, gather_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(nn.functional.silu(self.gate(x)) * self.up(x)))


def swiglu() -> tuple[nn.Module, None]:
    return SwiGLU(), None


def eager_tp(x: torch.Tensor) -> torch.Tensor:
    """On a rank: the same func() (same seed as the trace workers), run eagerly."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    nxd_state.model_parallel_manual_seed(0)
    model, _ = swiglu()
    with torch.no_grad():
        return model.eval()(x)


@pytest.mark.lock_only(reason="AOTInductor compiles C++ for minutes at torch 2.11")
def test_aot_inductor_trace_save_load(tmp_path: Path) -> None:
    expected = run_distributed(eager_tp, 2, X)[0]
    with parallel_model_trace(
        swiglu,
        X,
        compiler_workdir=tmp_path / "work",
        compiler_args={"aot_inductor": True},
        tp_degree=2,
    ) as model:
        compiled = model(X)
        parallel_model_save(model, tmp_path / "saved")
    torch.testing.assert_close(compiled, expected, **COMPILED)
    manifest = json.loads((tmp_path / "saved" / "manifest.json").read_text())
    assert manifest["compiler"]["aot_inductor"] is True
    assert [e["aoti"] for e in manifest["ranks"]] == [["tp_0.aoti.pt2"], ["tp_1.aoti.pt2"]]
    with parallel_model_load(tmp_path / "saved") as loaded:
        assert loaded.info["aot_inductor_loaded"]
        torch.testing.assert_close(loaded(X), compiled, **EXACT)
    with parallel_model_load(tmp_path / "saved", use_aot_inductor=False) as exported:
        torch.testing.assert_close(exported(X), expected, **EXACT)
