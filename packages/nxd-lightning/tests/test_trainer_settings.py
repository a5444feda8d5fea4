"""``Trainer(gradient_clip_val=..., accumulate_grad_batches=...)`` with NeuronLTModule (which
Lightning refuses under manual optimization; the strategy hands them to the module): the stock HF
Llama at TP=2 and at PP=2 on 2 ranks, clipping at 0.1 (not the config's 0.5: the Trainer's value
must win) with 2 accumulated micro-batches, equals one process on the global batch with torch's
``clip_grad_norm_(0.1)``: step losses, gradient norms before clipping, every parameter.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
STEPS, WORLD, CLIP, ACCUMULATE = 3, 2, 0.1, 2
# name -> (TP, PP, per-rank micro-batch): PP=2 needs 2 samples for its 2 pipeline micro-batches.
LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 2)}
SETTINGS = {"gradient_clip_val": CLIP, "accumulate_grad_batches": ACCUMULATE}


def both_layouts() -> dict[str, Any]:
    import nxd_state

    out: dict[str, Any] = {}
    for name, (tp, pp, batch) in LAYOUTS.items():
        run = R.lightning_run(
            "hf_llama", tp, pp, STEPS, batch=batch, world=WORLD, trainer_kwargs=SETTINGS
        )
        run["tp_rank"] = nxd_state.get_parallel_state().tensor_parallel_rank
        out[name] = run
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(both_layouts, WORLD)


def one_process(batch: int) -> dict[str, Any]:
    """The unmodified model, torch's AdamW, ``clip_grad_norm_(CLIP)``, global batches."""
    R._fresh_state()
    net = R.hf_llama()
    optimizer = torch.optim.AdamW(R.param_groups(net), **R.ADAMW)
    ids = R.dataset().ids
    losses, norms = [], []
    for rows in R.global_steps(1, batch, STEPS):
        loss = net(input_ids=ids[rows], labels=ids[rows]).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": dict(net.named_parameters())}


def _shard(full: torch.Tensor, local: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if local.shape == full.shape:
        return full
    (dim,) = [d for d in range(full.dim()) if local.shape[d] != full.shape[d]]
    return full.chunk(tp, dim=dim)[rank]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_clip_and_accumulation(results: list[dict[str, Any]], name: str) -> None:
    tp, pp, batch = LAYOUTS[name]
    reference = one_process(batch * ACCUMULATE)
    assert min(reference["norms"]) > CLIP  # clipping acts at every step
    holders = [r[name] for r in results if R.held(r[name]["losses"])]
    assert len(holders) == WORLD // pp
    for run in holders:
        assert run["global_step"] == STEPS
        # R.TOL: fp32 re-association (TP-split sums, micro-batch means) through 3 AdamW steps;
        # a summed instead of averaged accumulation doubles the norms, a clip at the config's
        # 0.5 instead of 0.1 moves the losses in the 3rd decimal.
        torch.testing.assert_close(
            torch.tensor(run["losses"]), torch.tensor(reference["losses"]), **R.TOL
        )
        torch.testing.assert_close(
            torch.tensor(run["grad_norms"]), torch.tensor(reference["norms"]), **R.TOL
        )
    covered = set()
    for rank in results:
        run = rank[name]
        for key, value in run["params"].items():
            full = _shard(reference["params"][key].detach(), value, tp, run["tp_rank"])
            torch.testing.assert_close(value, full, **R.TOL, msg=key)
            covered.add(key)
    assert covered == set(reference["params"])


def test_clip_value_goes_through_the_optimizer_config() -> None:
    """``gradient_clip_val`` rewrites ``optimizer_config`` through ``nxd_optim.OptimizerConfig``
    (a dict or an instance), so a bad key fails naming the closest one; no processes."""
    from nxd_lightning.module import _with_clipping
    from nxd_optim import OptimizerConfig

    given = OptimizerConfig(zero_one_enabled=True)  # clips at 1.0: replaced, with a warning
    with pytest.warns(UserWarning, match=r"replaces nxd_config's optimizer_config max_grad_norm"):
        out = _with_clipping({"tensor_parallel_size": 2, "optimizer_config": given}, CLIP)
    assert out["tensor_parallel_size"] == 2
    assert OptimizerConfig.from_nxd(out["optimizer_config"]) == OptimizerConfig(
        zero_one_enabled=True, grad_clipping=True, max_grad_norm=CLIP
    )
    with warnings.catch_warnings():  # nothing was clipped at another value: no warning
        warnings.simplefilter("error")
        off = _with_clipping({"optimizer_config": {"grad_clipping": False}}, CLIP)
        assert _with_clipping({}, CLIP)["optimizer_config"]["max_grad_norm"] == CLIP
    assert (off["optimizer_config"]["grad_clipping"], off["optimizer_config"]["max_grad_norm"]) == (
        True,
        CLIP,
    )
    with pytest.raises(ValueError, match=r"'max_grad_nrom' \(did you mean 'max_grad_norm'"):
        _with_clipping({"optimizer_config": {"max_grad_nrom": 1.0}}, CLIP)
