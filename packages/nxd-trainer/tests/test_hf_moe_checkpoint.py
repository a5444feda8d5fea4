"""Checkpoints of expert-parallel Hugging Face MoE models through the trainer API.

A tiny Mixtral / Qwen2-MoE (4 experts, top-2; ``_moe``) is parallelised by
``initialize_parallel_model`` at EP2 = DP2 (2 ranks), trained two AdamW steps by
``initialize_parallel_optimizer``'s NxDOptimizer (no ZeRO-1, clipping 0.5) and saved with
``save_checkpoint`` (model + optimizer). Then:

* **resume at the same degree**: each rank trains a third step (the uninterrupted run), then a
  fresh model built from another seed and a fresh optimizer load the checkpoint and train the
  same third step: its loss, every parameter and every optimizer-state tensor equal the
  uninterrupted run's bitwise (same degrees on CPU: the same operations in the same order);
  right after the load, every tensor equals the saved one bitwise.
* **resharding on load**: the folder loads at EP1 (one process: experts kept whole by
  transformers' own module) and at TP2 x EP2 (4 ranks; Qwen2-MoE under ``-m slow``: each
  expert's features over TP, ``gate_up_proj`` split along dim 1 with stride 2, ``down_proj``
  along dim 2). Every parameter and Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) equals the
  saved run's: the all-experts tensors are the EP ranks' slices concatenated, and each TP rank's
  expert slice is cut here from them by hand (gate rows then up rows of its features), so the
  test checks nxd-ckpt's reassembly and not a gather that could share its mistake.

* **sharded checkpoint and export**: ``save_model_sharded_checkpoint`` at EP2 loads back with
  ``load_model_sharded_checkpoint`` (parameters and logits bitwise); ``export_hf`` writes the
  experts per expert under the names transformers' ``save_pretrained`` writes (Mixtral's
  ``block_sparse_moe.experts.N.w1/w3/w2``, Qwen's ``mlp.experts.N.gate_proj/up_proj/down_proj``),
  in one file and in several shards (the index maps each name to its file), and
  ``AutoModelForCausalLM.from_pretrained`` loads both folders, no tensor missing or left over,
  with the trained EP model's logits (``LOGITS_TOL``).

Loading copies bytes (same dtype): every comparison but the exported logits is exact
(rtol = atol = 0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

M = load_sibling(__file__, "_moe")
EXACT = {"rtol": 0.0, "atol": 0.0}
ADAMW = {"lr": 1e-2, "eps": 1e-4}
MAX_NORM, STEPS = 0.5, 2
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _setup(family: str, tp: int, ep: int, seed: int) -> tuple[Any, Any, Any]:
    import nxd_state
    import nxd_trainer as nxd

    nxd_state.destroy_model_parallel()
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        expert_parallel_size=ep,
        optimizer_config={"zero_one_enabled": False, "max_grad_norm": MAX_NORM},
    )
    model = nxd.initialize_parallel_model(nxd_config, lambda: M.moe_model(family, seed))
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), **ADAMW
    )
    return nxd_config, model, optimizer


def _step(model: Any, optimizer: Any, step: int) -> float:
    import nxd_state

    state = nxd_state.get_parallel_state()
    ids = M.batches(state.data_parallel_size, seed=30 + step)[state.data_parallel_rank]
    loss = float(model.run_train(input_ids=ids, labels=ids))
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _snapshot(model: Any, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Each local parameter and its Adam state, by parameter name (clones)."""
    out = {}
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        out[name] = {"param": param.detach().clone()}
        out[name].update({key: state[key].detach().clone() for key in STATE_KEYS})
    return out


def _assert_equal(got: dict[str, Any], want: dict[str, Any], case: str) -> None:
    assert sorted(got) == sorted(want), case
    for name, tensors in want.items():
        for key, value in tensors.items():
            torch.testing.assert_close(
                got[name][key], value, **EXACT, msg=lambda m, n=name, k=key: f"{case} {n} {k}: {m}"
            )


def _save_and_resume(family: str, root: str) -> dict[str, Any]:
    """EP2 = DP2: train, save, train on (uninterrupted); then resume in a fresh model and
    train the same step; returns the saved snapshot (this rank's tensors)."""
    import nxd_state
    import nxd_trainer as nxd

    nxd_config, model, optimizer = _setup(family, 1, 2, seed=0)
    for step in range(STEPS):
        _step(model, optimizer, step)
    saved = _snapshot(model, optimizer)
    nxd.save_checkpoint(root, "step2", model=model, optimizer=optimizer, nxd_config=nxd_config)
    loss = _step(model, optimizer, STEPS)
    uninterrupted = _snapshot(model, optimizer)

    _, model, optimizer = _setup(family, 1, 2, seed=1)  # other weights until the load
    rank = nxd_state.get_parallel_state().rank
    nxd.load_checkpoint(root, "step2", model=model, optimizer=optimizer)
    _assert_equal(_snapshot(model, optimizer), saved, f"{family} loaded rank={rank}")
    assert _step(model, optimizer, STEPS) == loss, f"{family} resumed loss rank={rank}"
    _assert_equal(_snapshot(model, optimizer), uninterrupted, f"{family} resumed rank={rank}")
    expert_rows = {n for n, p in model.named_parameters() if M.is_expert(p)}
    return {"saved": saved, "experts": sorted(expert_rows)}


def _loaded(family: str, tp: int, ep: int, root: str) -> dict[str, Any]:
    """A fresh model and optimizer at (TP, EP), loaded from ``root``: this rank's tensors (other
    TP-sharded tensors gathered over TP; experts as held) and its TP and EP ranks."""
    import nxd_state
    import nxd_trainer as nxd

    _, model, optimizer = _setup(family, tp, ep, seed=1)
    nxd.load_checkpoint(root, "step2", model=model, optimizer=optimizer)
    state = nxd_state.get_parallel_state()
    tensors = _snapshot(model, optimizer)
    for name, param in model.named_parameters():
        if not M.is_expert(param):
            for key in ("param", "exp_avg", "exp_avg_sq"):
                tensors[name][key] = M.R.H.full(param, tensors[name][key], name, model.config)
    return {
        "tensors": tensors,
        "tp_rank": state.tensor_parallel_rank,
        "ep_rank": state.expert_model_parallel_rank,
    }


def _global(saved: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """The saved run's tensors, experts as the all-experts tensor (EP ranks' rows joined)."""
    experts = set(saved[0]["experts"])
    out = {}
    for name, tensors in saved[0]["saved"].items():
        out[name] = {}
        for key, value in tensors.items():
            if name in experts and key != "step":
                value = torch.cat([rank["saved"][name][key] for rank in saved])
            out[name][key] = value
    return out


def _tp_slice(name: str, value: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Expert tensor ``value`` (E', ...) cut for TP rank ``rank`` by hand: ``gate_up_proj``
    (E', 2I, H) -> its gate rows then its up rows of features ``[rank I/tp, (rank+1) I/tp)``;
    ``down_proj`` (E', H, I) -> those columns."""
    if name.endswith("gate_up_proj"):
        gate, up = value.chunk(2, dim=1)
        return torch.cat([g.chunk(tp, dim=1)[rank] for g in (gate, up)], dim=1)
    assert name.endswith("down_proj"), name
    return value.chunk(tp, dim=2)[rank]


def _expect(
    full: dict[str, dict[str, torch.Tensor]], experts: set[str], rank: dict[str, Any], tp: int
) -> dict[str, dict[str, torch.Tensor]]:
    """What ``rank`` of a TP x EP2 load must hold: experts its EP rank's rows, cut for its TP
    rank; other tensors whole (gathered by ``_loaded``)."""
    out = {}
    for name, tensors in full.items():
        out[name] = {}
        for key, value in tensors.items():
            if name in experts and key != "step":
                local = value.shape[0] // 2
                value = value[rank["ep_rank"] * local : (rank["ep_rank"] + 1) * local]
                if tp > 1:
                    value = _tp_slice(name, value, tp, rank["tp_rank"])
            out[name][key] = value
    return out


def _save(family: str, tmp_path: Path) -> tuple[dict[str, Any], set[str]]:
    saved = run_distributed(_save_and_resume, 2, family, str(tmp_path))
    experts = set(saved[0]["experts"])
    assert experts, "no parameter is marked expert_model_parallel"
    assert experts == set(saved[1]["experts"])
    # the two EP ranks hold other experts: the checkpoint must keep both halves
    for name in experts:
        assert not torch.equal(saved[0]["saved"][name]["param"], saved[1]["saved"][name]["param"])
    return _global(saved), experts


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_ep2_saves_resumes_and_loads_at_ep1(family: str, tmp_path: Path) -> None:
    """EP2 = DP2 round-trips and resumes bitwise; the folder loads at EP1 (one process)."""
    full, _ = _save(family, tmp_path)
    (one,) = run_distributed(_loaded, 1, family, 1, 1, str(tmp_path))
    _assert_equal(one["tensors"], full, f"{family} ep=1")


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_ep2_checkpoint_loads_at_tp2_ep2(family: str, tmp_path: Path) -> None:
    """The EP2 checkpoint at TP2 x EP2 (4 ranks): experts and TP slices equal the saved."""
    full, experts = _save(family, tmp_path)
    for rank in run_distributed(_loaded, 4, family, 2, 2, str(tmp_path)):
        want = _expect(full, experts, rank, 2)
        case = f"{family} tp=2 ep=2 tp_rank={rank['tp_rank']} ep_rank={rank['ep_rank']}"
        _assert_equal(rank["tensors"], want, case)


EVAL_SEED = 99
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-5}
"""fp32: the EP run adds each token's expert outputs after an all-to-all, in the same expert
order; the one-process model's matmuls run on other row blocks (~1e-7 relative on O(1) logits,
which through two layers reached 1.4e-6 absolute on a logit near zero at transformers 5.4).
A wrong expert, or gate and up rows swapped, is off by O(1)."""


def _eval_logits(model: Any) -> torch.Tensor:
    """Logits of one fixed batch (the same on every rank), in eval mode."""
    ids = M.batches(1, seed=EVAL_SEED)[0]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.detach().clone()
    model.train()
    return logits


def _sharded(family: str, root: str) -> dict[str, Any]:
    """EP2 = DP2: train two steps, ``save_model_sharded_checkpoint`` the model (and its
    optimizer), load it into a fresh model with ``load_model_sharded_checkpoint``; the trained
    model's logits of the eval batch."""
    from nxd_trainer.hf import load_model_sharded_checkpoint, save_model_sharded_checkpoint

    _, model, optimizer = _setup(family, 1, 2, seed=0)
    for step in range(STEPS):
        _step(model, optimizer, step)
    save_model_sharded_checkpoint(model.module, root, optimizer=optimizer)
    logits = _eval_logits(model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    _, fresh, _ = _setup(family, 1, 2, seed=1)
    load_model_sharded_checkpoint(fresh.module, root)
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(param.detach(), params[name], **EXACT, msg=name)
    torch.testing.assert_close(_eval_logits(fresh), logits, **EXACT)
    return {"logits": logits}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_ep2_sharded_checkpoint_exports_a_transformers_folder(family: str, tmp_path: Path) -> None:
    """``save_model_sharded_checkpoint`` at EP2 round-trips through
    ``load_model_sharded_checkpoint``; ``export_hf`` writes a folder whose experts are stored per
    expert, as transformers writes them, and which ``from_pretrained`` loads with the trained
    model's logits."""
    import transformers

    from nxd_trainer.hf import export_hf

    ranks = run_distributed(_sharded, 2, family, str(tmp_path / "sharded"))
    torch.testing.assert_close(ranks[0]["logits"], ranks[1]["logits"], **EXACT)
    out = export_hf(tmp_path / "sharded", tmp_path / "hf")

    exported_names = _names(tmp_path / "hf")
    block, projections = {"mixtral": ("block_sparse_moe", "w1 w3 w2")}.get(
        family, ("mlp", "gate_proj up_proj down_proj")
    )
    per_expert = {
        f"model.layers.{layer}.{block}.experts.{e}.{proj}.weight"
        for layer in range(2)
        for e in range(M.EXPERTS)
        for proj in projections.split()
    }
    assert per_expert <= exported_names, sorted(per_expert - exported_names)
    assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in exported_names)
    reference = M.moe_model(family)
    reference.save_pretrained(tmp_path / "reference")
    transformers_names = _names(tmp_path / "reference")
    if per_expert <= transformers_names:  # this transformers writes experts per expert
        assert exported_names == transformers_names, sorted(exported_names ^ transformers_names)

    # several shards (20 kB each): the index maps every per-expert name to its shard
    shards = export_hf(tmp_path / "sharded", tmp_path / "shards", max_shard_size=20_000)
    weight_map = json.loads((shards / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert set(weight_map) == exported_names == _names(shards)
    for name, shard in weight_map.items():
        assert name in _names(shards, shard), (name, shard)

    for folder in (out, shards):
        exported, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, output_loading_info=True
        )
        assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
        torch.testing.assert_close(_eval_logits(exported), ranks[0]["logits"], **LOGITS_TOL)


def _names(folder: Path, pattern: str = "*.safetensors") -> set[str]:
    """The tensor names of a folder's safetensors files (those ``pattern`` matches)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(folder.glob(pattern)):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names
