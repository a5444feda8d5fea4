"""Gradient accumulation in ``nxd-train``'s loop is a mean, never a sum.

The same global batch (8 sequences) taken in one micro-step and in 4 accumulated ones must
give the same losses, gradient norms and weights over 3 optimizer steps, whatever holds the
gradients between backward and step: ``p.grad`` (DP=2), ZeRO-1's accumulators, the fp32
accumulation buffers of bf16 training (with and without ZeRO-1), a pipeline (PP=2, where the
schedule runs the backward), LoRA adapters. The loop scales the accumulated gradients with the
optimizer's public ``scale_gradients(1/k)``; a loop that divided ``p.grad`` instead left the
ZeRO-1 and fp32 accumulators summed (4x the norm, hidden in the loss by Adam's scale
invariance), which the grad-norm comparison catches.

Each rank builds the real :class:`nxd_trainer.train.Trainer` of a tiny run (the ``tiny``
preset, 32-token sequences) on data prepared once by the test.

Tolerances. fp32: every sequence has the same number of tokens, so the mean of the four
micro-batch means is the batch mean; what differs is the order of fp32 sums (~1e-7 relative):
losses and norms within rtol 1e-4 / atol 1e-5, as the other nxd-train parity tests; weights
within 1e-4, AdamW's normalised update amplifying round-off on near-zero gradient entries
(see FP32_WEIGHTS). The weights cannot tell a sum from a mean under AdamW (it is scale
invariant): the grad norm is what catches that. bf16: a 1-sequence micro-batch and the
4-sequence batch round their matmuls differently (bf16 has 8 significant bits, 2^-8 = 0.4%),
and the fp32 accumulator sums four rounded gradients: losses and norms within 2% (a missed
1/4 is a 300% error); weights within the sum of both runs' AdamW updates (|update| <= lr).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_run")
STEPS = 3
FP32 = {"rtol": 1e-4, "atol": 1e-5}
# An entry whose gradient is near AdamW's eps (1e-8) moves by about lr·g/(|g| + eps): the
# last bits of g, which the order of fp32 sums changes, decide a visible part of its step.
# 1e-4 is 1/30 of one step's lr (3e-3) and 1/200 of the weights' scale (std 0.02).
FP32_WEIGHTS = {"rtol": 1e-4, "atol": 1e-4}
BF16 = {"rtol": 2e-2, "atol": 1e-6}
# Two AdamW trajectories of bf16 weights can differ by at most the sum of both runs' updates
# (|update| <= lr per step): lr ramps 1.5e-3, 3e-3, 3e-3 over the 3 steps (2 warm-up steps).
BF16_WEIGHTS = {"rtol": 0.0, "atol": 2 * (1.5e-3 + 3e-3 + 3e-3)}
VARIANTS = {
    "dp2": ["--tp", "1"],
    "dp2_zero1": ["--tp", "1", "--zero1"],
    "dp2_bf16_fp32_accumulation": ["--tp", "1", "--bf16"],
    "dp2_bf16_zero1": ["--tp", "1", "--bf16", "--zero1"],
    "pp2": ["--tp", "1", "--pp", "2", "--microbatches", "2"],
    "dp2_lora": ["--tp", "1", "--lora-rank", "4"],
}


def _train(run_dir: str, flags: list[str]) -> dict[str, Any]:
    """One rank: a Trainer at grad_accum 1 and one at 4, 3 steps each, on the same data."""
    import nxd_state
    from nxd_trainer.train import RunDir, Trainer, parse_config
    from nxd_trainer.train.data import prepare_data

    out: dict[str, Any] = {}
    for k in (1, 4):
        cfg = parse_config([*R.TINY, "--runs-dir", str(Path(run_dir).parent), "--name",
                            Path(run_dir).name, "--batch-size", "8", "--grad-accum", str(k),
                            "--steps", str(STEPS), *flags])  # fmt: skip
        trainer = Trainer(cfg, RunDir.of(cfg), prepare_data(cfg, build=False))
        results = [trainer.train_step() for _ in range(STEPS)]
        out[k] = {
            "loss": [r.loss for r in results],
            "grad_norm": [r.grad_norm for r in results],
            "params": {
                n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()
            },
        }
        nxd_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder with its tokenizer and packed data (what the launcher prepares)."""
    from nxd_trainer.train import parse_config
    from nxd_trainer.train.data import prepare_data

    runs = tmp_path_factory.mktemp("runs")
    prepare_data(parse_config([*R.TINY, "--runs-dir", str(runs), "--name", "acc"]), build=True)
    return runs / "acc"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_accumulated_steps_equal_one_batch(prepared: Path, variant: str) -> None:
    flags = VARIANTS[variant]
    tol = BF16 if "--bf16" in flags else FP32
    for rank, got in enumerate(run_distributed(_train, 2, str(prepared), flags)):
        one, four = got[1], got[4]
        label = f"{variant} rank {rank}"
        # The norm first: a sum instead of a mean shows as 4x here.
        torch.testing.assert_close(
            torch.tensor(four["grad_norm"]), torch.tensor(one["grad_norm"]), **tol, msg=label
        )
        torch.testing.assert_close(
            torch.tensor(four["loss"]), torch.tensor(one["loss"]), **tol, msg=label
        )
        assert one["params"].keys() == four["params"].keys()
        weights = BF16_WEIGHTS if "--bf16" in flags else FP32_WEIGHTS
        for name, value in one["params"].items():
            torch.testing.assert_close(
                four["params"][name],
                value,
                **weights,
                msg=lambda m, n=name, at=label: f"{at} {n}: {m}",
            )
