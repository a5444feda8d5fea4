"""Checkpoints at expert parallelism > 1, resharded across EP (and TP) degrees.

The model: a dense linear, then ``nxd_layers.moe.MoE`` (top-2 of 4 gated-SiLU experts,
dropless), trained two AdamW steps through ``NxDOptimizer`` on each rank's own rows.

* EP=2 on 4 ranks (DP=4: expert-DP groups of 2 replicas) saves; every (tensor, box) is written
  by exactly one rank (the manifests) and the index holds every expert (global shape (4, …)).
  The folder loads at EP=4 (same 4 ranks) and at EP=1 (one process): every parameter and every
  optimizer-state tensor (Adam moments, step; fp32 masters of bf16 parameters) equals the saved
  run's, the experts of each EP rank at their rows of the all-experts tensor.
* EP=1 (one process) saves; the folder loads at TP=2 x EP=2 (4 ranks): each rank's experts and
  TP columns/rows equal the one-process tensors' slices.
* Refused, naming the values, before anything is written or read: at EP=2 a ZeRO-1 optimizer
  with one flat layout over expert parameters (``NeuronEPZero1Optimizer``, which shards them
  over expert-DP, is tested in test_ep_zero1.py) or an EP-aware one built at another EP
  degree, and a checkpoint of 3 experts loaded at EP=2.

The loaded values are bytes copied from the saved ones (same dtype), so every comparison is
exact (rtol=atol=0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_state.testing import run_distributed

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 8, 4, 2, 4
ROWS, SEQ, STEPS = 2, 3, 2
EXACT = {"rtol": 0.0, "atol": 0.0}  # bytes copied: no arithmetic between save and load
EXPERT_PARAMS = ("moe.expert_mlps.gate_up_proj.weight", "moe.expert_mlps.down_proj.weight")


class DenseThenMoE(nn.Module):
    """x -> Linear(8, 8) -> MoE (top-2 of ``experts`` gated-SiLU experts, dropless)."""

    def __init__(self, seed: int, dtype: torch.dtype, experts: int = EXPERTS) -> None:
        super().__init__()
        from nxd_layers.moe import ExpertMLPsCapacityFactor, MoE, RouterTopK

        torch.manual_seed(seed)  # experts drawn full and sliced: the same at any EP degree
        self.dense = nn.Linear(HIDDEN, HIDDEN, dtype=dtype)
        router = RouterTopK(experts, TOP_K, HIDDEN, dtype=dtype)
        mlps = ExpertMLPsCapacityFactor(
            experts, TOP_K, HIDDEN, INTERMEDIATE, "silu", None, True, dtype=dtype
        )
        self.moe = MoE(router, mlps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe(self.dense(x))[0]
        return out


def _optimizer(model: nn.Module) -> Any:
    from nxd_optim import MixedPrecisionConfig, NxDOptimizer

    # bf16: fp32 masters kept and saved
    mixed = MixedPrecisionConfig(use_master_weights=True, use_master_weights_in_ckpt=True)
    return NxDOptimizer(model.parameters(), torch.optim.AdamW, mixed_precision=mixed, lr=1e-2)


def _train(model: nn.Module, optimizer: Any, rank: int, dtype: torch.dtype) -> None:
    """STEPS AdamW steps of mean-squared error on this rank's rows of a fixed batch."""
    gen = torch.Generator().manual_seed(11 + rank)
    for _ in range(STEPS):
        x = torch.randn(ROWS, SEQ, HIDDEN, generator=gen).to(dtype)
        target = torch.randn(ROWS, SEQ, HIDDEN, generator=gen).to(dtype)
        optimizer.zero_grad()
        ((model(x) - target) ** 2).mean().backward()
        optimizer.step()


def _snapshot(model: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {"param", "exp_avg", "exp_avg_sq", "step", ("master")}} as this rank
    holds them (the optimizer state is keyed by the fp32 master of a bf16 parameter)."""
    masters = optimizer.master_weights_by_param()
    out = {}
    for name, param in model.named_parameters():
        stepped = masters.get(param, param)
        entry = {"param": param.detach().clone()}
        entry.update({k: v.clone() for k, v in optimizer.optimizer.state[stepped].items()})
        if param in masters:
            entry["master"] = stepped.detach().clone()
        out[name] = entry
    return out


def _ep_rank() -> int:
    import nxd_state

    return nxd_state.get_expert_model_parallel_rank()


def _ep2_save_then_ep4_load(path: str, dtype: torch.dtype) -> dict[str, Any]:
    import nxd_state

    nxd_state.initialize_model_parallel(expert_model_parallel_size=2)  # DP=4, expert-DP=2
    model = DenseThenMoE(0, dtype)
    optimizer = _optimizer(model)
    _train(model, optimizer, nxd_state.get_data_parallel_rank(), dtype)
    save_checkpoint(path, "ep2", model=model, optimizer=optimizer)
    saved = {"ep_rank": _ep_rank(), "state": _snapshot(model, optimizer)}
    nxd_state.destroy_model_parallel()

    nxd_state.initialize_model_parallel(expert_model_parallel_size=4)  # DP=4, expert-DP=1
    fresh = DenseThenMoE(1, dtype)  # other weights, empty state: only the load can fix them
    fresh_optimizer = _optimizer(fresh)
    load_checkpoint(path, "ep2", model=fresh, optimizer=fresh_optimizer)
    loaded = {"ep_rank": _ep_rank(), "state": _snapshot(fresh, fresh_optimizer)}
    return {"saved": saved, "loaded": loaded}


def _full(results: list[dict[str, Any]], ep: int) -> dict[str, dict[str, torch.Tensor]]:
    """The all-experts state from the ranks of one EP layout; replicas must agree."""
    by_ep: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for result in results:
        first = by_ep.setdefault(result["ep_rank"], result["state"])
        for name, entry in result["state"].items():  # expert-DP replicas hold the same
            for key, value in entry.items():
                torch.testing.assert_close(value, first[name][key], **EXACT)
    assert sorted(by_ep) == list(range(ep))
    full = {}
    for name, entry in by_ep[0].items():
        full[name] = {
            key: torch.cat([by_ep[r][name][key] for r in range(ep)])
            if name in EXPERT_PARAMS and value.dim() > 0
            else value
            for key, value in entry.items()
        }
    return full


def _assert_slices(state: dict[str, dict[str, torch.Tensor]], full: dict, rows: slice) -> None:
    """``state`` (one rank's) equals ``full`` with experts cut to ``rows``, every key."""
    assert set(state) == set(full)
    for name, entry in state.items():
        assert set(entry) == set(full[name]), name
        for key, value in entry.items():
            expected = full[name][key]
            if name in EXPERT_PARAMS and value.dim() > 0:
                expected = expected[rows]
            torch.testing.assert_close(value, expected, **EXACT, msg=f"{name}/{key}")


def _check_written_once(tag_dir: Path) -> None:
    """Across every rank's manifest, each (tensor, box) is written once, and the expert
    tensors are declared with all experts (dim 0 = EXPERTS)."""
    (data,) = tag_dir.glob("data-*")
    written: list[tuple[str, str, tuple[int, ...]]] = []
    for manifest in sorted(data.glob("manifest_rank_*.json")):
        for chunk in json.loads(manifest.read_text())["chunks"]:
            written.append((chunk["category"], chunk["name"], tuple(chunk["offsets"])))
    model_chunks = [w for w in written if w[0] in ("model", "optimizer")]
    assert len(model_chunks) == len(set(model_chunks)), "a box was written twice"
    index = json.loads((tag_dir / "index.json").read_text())
    for name in EXPERT_PARAMS:
        record = index["tensors"]["model"][name]
        assert record["shape"][0] == EXPERTS
        assert sorted(c["offsets"][0] for c in record["chunks"]) == [0, EXPERTS // 2]
    assert index["parallel"]["expert_model_parallel_size"] == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ep2_checkpoint_loads_at_ep4_and_in_one_process(tmp_path: Path, dtype: torch.dtype) -> None:
    results = run_distributed(_ep2_save_then_ep4_load, 4, str(tmp_path), dtype)
    _check_written_once(tmp_path / "ep2")
    full = _full([r["saved"] for r in results], 2)
    assert ("master" in full["dense.weight"]) == (dtype == torch.bfloat16)
    local = EXPERTS // 4
    for result in results:  # EP=4: each rank's one expert and the replicated rest
        rank = result["loaded"]["ep_rank"]
        _assert_slices(result["loaded"]["state"], full, slice(rank * local, (rank + 1) * local))

    (one_process,) = run_distributed(_one_process_load, 1, str(tmp_path), dtype)
    _assert_slices(one_process, full, slice(None))  # EP=1: every expert on the one rank


def _one_process_load(path: str, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    import nxd_state

    nxd_state.initialize_model_parallel()  # one rank (NxDOptimizer needs a parallel state)
    model = DenseThenMoE(2, dtype)
    optimizer = _optimizer(model)
    load_checkpoint(path, "ep2", model=model, optimizer=optimizer)
    return _snapshot(model, optimizer)


def _tp2_ep2_load(path: str) -> dict[str, Any]:
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    model = DenseThenMoE(1, torch.float64)
    optimizer = _optimizer(model)
    load_checkpoint(path, "ep1", model=model, optimizer=optimizer)
    return {
        "ep_rank": _ep_rank(),
        "tp_rank": nxd_state.get_tensor_model_parallel_rank(),
        "state": _snapshot(model, optimizer),
    }


def _tp_cut(name: str, value: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The TP rank's part of an (experts, …) tensor (experts.py's split): columns
    ``t`` of the gate and of the up halves of ``gate_up_proj``, rows ``t`` of ``down_proj``."""
    width = INTERMEDIATE // 2
    mine = torch.arange(tp_rank * width, (tp_rank + 1) * width)
    if name.endswith("gate_up_proj.weight"):
        return value[:, :, torch.cat([mine, mine + INTERMEDIATE])]
    return value[:, mine]


def _one_process_save(path: str) -> dict[str, dict[str, torch.Tensor]]:
    import nxd_state

    nxd_state.initialize_model_parallel()  # one rank: EP=1, TP=1
    model = DenseThenMoE(0, torch.float64)
    optimizer = _optimizer(model)
    _train(model, optimizer, 0, torch.float64)
    save_checkpoint(path, "ep1", model=model, optimizer=optimizer)
    return _snapshot(model, optimizer)


def test_ep1_checkpoint_loads_at_tp2_ep2(tmp_path: Path) -> None:
    (full,) = run_distributed(_one_process_save, 1, str(tmp_path))
    results = run_distributed(_tp2_ep2_load, 4, str(tmp_path))
    assert sorted((r["ep_rank"], r["tp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    local = EXPERTS // 2
    for result in results:
        rows = slice(result["ep_rank"] * local, (result["ep_rank"] + 1) * local)
        for name, entry in result["state"].items():
            for key, value in entry.items():
                expected = full[name][key]
                if name in EXPERT_PARAMS and value.dim() > 0:
                    expected = _tp_cut(name, expected[rows], result["tp_rank"])
                torch.testing.assert_close(value, expected, **EXACT, msg=f"{name}/{key}")


def _zero1_at_ep2(path: str) -> list[str]:
    import nxd_state
    from nxd_optim import NeuronEPZero1Optimizer, NxDOptimizer, OptimizerConfig

    # A ZeRO-1 with one flat layout over experts at EP > 1 (nxd-optim refuses to build one
    # there): built at EP=1 over a parameter marked as EP=2 experts, it stands in. So does an
    # EP-aware one built at EP=1 (its experts in the dense half, sharded over DP x CP).
    nxd_state.initialize_model_parallel()
    model = nn.Linear(4, 4, bias=False)
    model.weight.expert_model_parallel = True  # type: ignore[attr-defined]
    model.weight.expert_partition_dim = 0  # type: ignore[attr-defined]
    model.weight.expert_model_parallel_size = 2  # type: ignore[attr-defined]
    zero1 = NxDOptimizer(
        model.parameters(), torch.optim.AdamW, config=OptimizerConfig(zero_one_enabled=True)
    )
    ep_zero1 = NeuronEPZero1Optimizer(model.parameters(), torch.optim.AdamW)
    nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(expert_model_parallel_size=2)
    messages = []
    with pytest.raises(NotImplementedError, match="ZeRO-1") as error:
        save_checkpoint(path, "zero1", model=model, optimizer=zero1)
    messages.append(str(error.value))
    save_checkpoint(path, "model_only", model=model)  # the experts themselves save at EP=2
    with pytest.raises(NotImplementedError, match="ZeRO-1") as error:
        load_checkpoint(path, "model_only", model=model, optimizer=zero1)
    messages.append(str(error.value))
    with pytest.raises(NotImplementedError, match="dense half") as error:
        save_checkpoint(path, "ep_zero1", model=model, optimizer=ep_zero1)
    messages.append(str(error.value))
    return messages


def test_zero1_at_ep2_is_refused_before_writing(tmp_path: Path) -> None:
    for messages in run_distributed(_zero1_at_ep2, 2, str(tmp_path)):
        for message in messages:
            assert "expert_model_parallel_size=2" in message
        for message in messages[:2]:  # the two supported ways named
            assert "NeuronEPZero1Optimizer" in message
            assert "zero_one_enabled=False" in message
        assert "1 expert parameter(s)" in messages[2]
    assert not (tmp_path / "zero1").exists()
    assert not (tmp_path / "ep_zero1").exists()


def _three_experts_at_ep2(path: str) -> str:
    import nxd_state

    nxd_state.initialize_model_parallel(expert_model_parallel_size=2)
    model = DenseThenMoE(1, torch.float64)  # 4 experts: 2 per EP rank
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="3 experts") as error:
        load_checkpoint(path, "three", model=model)
    for name, value in model.state_dict().items():  # refused before any read
        torch.testing.assert_close(value, before[name], **EXACT)
    return str(error.value)


def test_expert_count_the_ep_degree_does_not_divide_is_refused(tmp_path: Path) -> None:
    save_checkpoint(str(tmp_path), "three", model=DenseThenMoE(0, torch.float64, experts=3))
    for message in run_distributed(_three_experts_at_ep2, 2, str(tmp_path)):
        assert "expert_model_parallel_size=2 does not divide" in message
        assert "moe.expert_mlps.gate_up_proj.weight" in message
