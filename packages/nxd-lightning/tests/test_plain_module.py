"""A plain LightningModule (automatic optimization, torch's SGD, nothing nxd-specific) under
NxDStrategy trains like one process, as DDP would make it.

One 2-rank spawn runs every case: DP=2 (each rank half of the global batch, the replicas built
from different seeds so the start from DP rank 0 is tested too), with ``gradient_clip_val``,
with ``accumulate_grad_batches=2`` (batches of 1), with manual optimization (manual_backward and
clip_gradients in training_step), and TP=2 on the same MLP written with nxd's TP layers with
``gradient_clip_val`` (the norm over TP). Each is compared with torch alone on the global batch:
the step losses, every gradient the optimizer used (after clipping) and every parameter after
each step. Then the refusals: TP=2 and PP=2 on the plain MLP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
P = load_sibling(__file__, "_plain_recipe")
STEPS, WORLD = 3, 2
# clip 0.05 is below every step's gradient norm (asserted), so clipping acts in each step.
CLIP = 0.05
# name -> (TP, per-rank batch, accumulate_grad_batches, gradient_clip_val, manual, TP layers)
CASES: dict[str, tuple[int, int, int, float, bool, bool]] = {
    "dp2": (1, 2, 1, 0.0, False, False),
    "dp2_clip": (1, 2, 1, CLIP, False, False),
    "dp2_accumulate": (1, 1, 2, 0.0, False, False),
    "dp2_manual_clip": (1, 2, 1, CLIP, True, False),
    "tp2_clip": (2, 4, 1, CLIP, False, True),
}
# fp32: the DP mean of two half-batch means vs one mean of the whole batch, and TP's split
# matmul sums, differ by re-association round-off (~1e-7 relative), which three SGD steps
# (lr 0.5, momentum 0.9) carry into the parameters without amplifying it by more than ~10x.
# A missing DP average leaves each replica on its own half-batch: the gradients differ in the
# first decimal; a norm taken over one TP shard clips by a different factor (~1e-1 relative).
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _fit(tp: int, batch: int, accumulate: int, clip: float, manual: bool, tp_layers: bool) -> Any:
    import torch.distributed as dist
    from lightning.pytorch import Trainer

    import nxd_state
    from nxd_lightning import NxDStrategy

    nxd_state.destroy_model_parallel()
    rank = dist.get_rank()
    if tp_layers:  # the TP layers need the groups; the strategy keeps them (same sizes)
        nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        module = P.TPClassifier(seed=0)
    else:  # each replica from its own seed: the strategy must start them from DP rank 0's
        module = P.Classifier(seed=rank, manual=manual, clip=clip if manual else 0.0)
    recorder = P.GradRecorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=NxDStrategy(tensor_parallel_size=tp),
        max_steps=STEPS,
        gradient_clip_val=None if manual or not clip else clip,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[recorder],
    )
    trainer.fit(module, train_dataloaders=P.loader(batch))
    return module, recorder


def _refusal(tp: int, pp: int) -> str:
    from lightning.pytorch import Trainer

    import nxd_state
    from nxd_lightning import NxDStrategy

    nxd_state.destroy_model_parallel()
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=NxDStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(P.Classifier(), train_dataloaders=P.loader(2))
    except ValueError as error:
        return str(error)
    return "no error"


def every_case() -> dict[str, Any]:
    import nxd_state

    out: dict[str, Any] = {}
    for name, case in CASES.items():
        module, recorder = _fit(*case)
        out[name] = {
            "losses": module.losses,
            "grads": recorder.grads,
            "params": recorder.params,
            "tp_rank": nxd_state.get_tensor_model_parallel_rank(),
        }
    out["refused_tp"] = _refusal(2, 1)
    out["refused_pp"] = _refusal(1, 2)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(every_case, WORLD)


def _shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TPClassifier's slice: fc1 column-parallel (rows), fc2 row-parallel (columns; bias
    replicated)."""
    if tp == 1 or name == "fc2.bias":
        return full
    return full.chunk(tp, 1 if name == "fc2.weight" else 0)[rank]


@pytest.mark.parametrize("name", list(CASES))
def test_plain_module_trains_like_one_process(results: list[dict[str, Any]], name: str) -> None:
    tp, batch, accumulate, clip, _, _ = CASES[name]
    dp = WORLD // tp
    rows = R.global_steps(dp, batch * accumulate, STEPS)
    reference = P.one_process(STEPS, rows, clip=clip)
    if clip:
        assert min(reference["norms"]) > clip, reference["norms"]  # clipping acts
    # The step's loss: each rank's micro-batch means, averaged over micro-batches and ranks
    # (TP ranks of one replica hold the same loss).
    per_rank = torch.tensor([r[name]["losses"] for r in results]).view(WORLD, STEPS, accumulate)
    replicas = per_rank[::tp].mean(dim=(0, 2))
    torch.testing.assert_close(replicas, torch.tensor(reference["losses"]), **TOL)
    for rank in results:
        run = rank[name]
        assert len(run["params"]) == STEPS
        for step in range(STEPS):
            for kind in ("grads", "params"):
                ours = run[kind][step]
                assert ours.keys() == reference[kind][step].keys()
                for key, value in ours.items():
                    full = reference[kind][step][key]
                    expected = _shard(key, full, tp, run["tp_rank"])
                    torch.testing.assert_close(value, expected, **TOL, msg=f"{kind} {key}")


def test_tp_or_pp_without_parallel_layers_is_refused(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert (
            "tensor_parallel_size=2 but Classifier holds no nxd tensor-parallel layer"
            in (rank["refused_tp"])
        )
        assert (
            "pipeline_parallel_size=2 with Classifier, a plain LightningModule"
            in (rank["refused_pp"])
        )
