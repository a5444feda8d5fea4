"""★ The reshard matrix: a checkpoint saved at (TP, PP, DP, ZeRO-1) = (2, 2, 2, on) loads at
(1, 1, 1, off), (4, 1, 2, on), (1, 2, 4, on) and (2, 1, 1, off), and back, and training
continues as if it had never stopped.

The source run (8 gloo ranks) trains a tiny GPT (TP blocks, 2 pipeline stages, ZeRO-1 AdamW
with clipping) for 2 steps, saves, and trains 2 more: that is the uninterrupted reference.
Every target builds the model from a *different* seed, loads the checkpoint, and trains the
same 2 steps on the same global batches.

* Right after loading, every parameter equals the saved one bitwise (loading copies bytes).
* Same degrees (2, 2, 2, on), and the round trip through (1, 1, 1, off) back to (2, 2, 2, on):
  the continued run equals the uninterrupted one bitwise (CPU, deterministic kernels).
* Other degrees: the continued run is the same computation with sums taken in another order
  (TP splits matmul reductions, DP averages gradients over other slices, PP sums micro-batch
  gradients), so results differ by fp32 rounding only. Two AdamW steps (lr 1e-2) move
  parameters by ~1e-2; Adam's m/(sqrt(v) + eps) keeps a gradient error of a few ulps a
  relative one (eps = 1e-5 stops it from inflating the rounding noise of the key bias, whose
  exact gradient is zero: see nxd_ckpt.testing), so parameters agree to rtol 1e-5 / atol
  1e-6 (measured: within 3e-7). A lost or misplaced optimizer state (moments, step count for
  bias correction, masters) changes the update by O(lr) = 1e-2 and fails by orders of
  magnitude.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_ckpt.testing import Degrees, build, full_state, train_step
from nxd_state.testing import run_distributed

SOURCE = Degrees(tp=2, pp=2, dp=2, zero1=True)
TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring


def _continue(path: str, tag: str, degrees: Degrees, save_as: str | None = None) -> dict:
    model, optimizer = build(degrees, seed=99)  # other weights: only the load can fix them
    load_checkpoint(path, tag, model=model, optimizer=optimizer)
    loaded = full_state(model)
    if save_as is not None:
        save_checkpoint(path, save_as, model=model, optimizer=optimizer)
    for step in (2, 3):
        train_step(model, optimizer, step)
    return {"loaded": loaded, "final": full_state(model)}


def eight_rank_runs(path: str) -> dict[str, Any]:
    model, optimizer = build(SOURCE)
    for step in (0, 1):
        train_step(model, optimizer, step)
    saved = full_state(model)
    save_checkpoint(path, "step2", model=model, optimizer=optimizer, user_content={"step": 2})
    for step in (2, 3):
        train_step(model, optimizer, step)
    out: dict[str, Any] = {"saved": saved, "reference": full_state(model)}
    for target in (SOURCE, Degrees(4, 1, 2, True), Degrees(1, 2, 4, True)):
        out[str(target)] = _continue(path, "step2", target)
    return out


def small_runs(path: str, tp: int, save_as: str | None) -> dict[str, Any]:
    return _continue(path, "step2", Degrees(tp, 1, 1, False), save_as)


def back_to_source(path: str) -> dict[str, Any]:
    return _continue(path, "back", SOURCE)


def _merge(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Union of the ranks' gathered parameters; copies held by several ranks must agree."""
    merged: dict[str, torch.Tensor] = {}
    for state in per_rank:
        for name, value in state.items():
            if name in merged:
                assert torch.equal(merged[name], value), f"replicas of {name} differ"
            merged[name] = value
    return merged


def _compare(got: dict, want: dict, label: str, **tol: float) -> None:
    assert got.keys() == want.keys(), f"{label}: parameter names differ"
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=f"{label}: {name}")


def test_reshard_matrix(tmp_path: Path) -> None:
    path = str(tmp_path)
    eight = run_distributed(eight_rank_runs, 8, path)
    saved = _merge([r["saved"] for r in eight])
    reference = _merge([r["reference"] for r in eight])
    assert len(reference) == 4 * 16 + 5  # every parameter of the 4-layer model is covered
    exact = {"rtol": 0.0, "atol": 0.0}
    for target in (SOURCE, Degrees(4, 1, 2, True), Degrees(1, 2, 4, True)):
        runs = [r[str(target)] for r in eight]
        _compare(_merge([r["loaded"] for r in runs]), saved, f"{target} loaded", **exact)
        tol = exact if target == SOURCE else TOL
        _compare(_merge([r["final"] for r in runs]), reference, f"{target} continued", **tol)

    one = run_distributed(small_runs, 1, path, 1, "back")
    two = run_distributed(small_runs, 2, path, 2, None)
    for label, runs in (("tp1-pp1-dp1-plain", one), ("tp2-pp1-dp1-plain", two)):
        _compare(_merge([r["loaded"] for r in runs]), saved, f"{label} loaded", **exact)
        _compare(_merge([r["final"] for r in runs]), reference, f"{label} continued", **TOL)

    back = run_distributed(back_to_source, 8, path)  # (2,2,2,on) -> (1,1,1,off) -> (2,2,2,on)
    _compare(_merge([r["loaded"] for r in back]), saved, "back loaded", **exact)
    _compare(_merge([r["final"] for r in back]), reference, "back continued", **exact)
