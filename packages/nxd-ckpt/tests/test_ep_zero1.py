"""Checkpoints of the EP-aware ZeRO-1 (``NeuronEPZero1Optimizer``), resharded.

The model: a dense linear, then ``nxd_layers.moe.MoE`` (top-2 of 4 gated-SiLU experts,
dropless), trained two AdamW steps through ``NxDOptimizer(zero_one_enabled=True)`` (at EP > 1
it builds ``NeuronEPZero1Optimizer``: dense state sharded over the DP x CP ranks, expert state
over the expert-DP group) on each rank's own rows, with the LR changed by hand before the save.

* EP=2 on 4 ranks (DP=4: expert-DP groups of 2) saves. Each (tensor, box) is written once and
  the chunks of every optimizer tensor tile its global shape (the manifests and the index);
  the expert state is stored with all experts (dim 0 = 4). The folder loads into a fresh model
  and optimizer at EP=2 (then one more step equals the saved run's next step bit for bit), at
  EP=4 (expert-DP 1) and at EP=1 (plain ZeRO-1 over DP=4) on the same 4 ranks, and into a
  non-ZeRO ``NxDOptimizer`` in one process. After each load every parameter and every
  optimizer-state tensor (Adam moments, step, the master weights the optimizer steps) equals
  the saved run's, and the LR is the saved one in the caller's groups and in both halves.
* A non-ZeRO ``NxDOptimizer`` at EP=2 saves; an EP-aware ZeRO-1 at EP=2 x expert-DP 2 loads it.
* DP 2 x CP 2 at EP=2 (expert-DP spanning CP) saves; DP=4 at EP=2 loads it.
* ``-m slow``: the EP=2 folder loads on 8 ranks at EP=4 x expert-DP 2, EP=2 x expert-DP 4
  and TP=2 x EP=2 x expert-DP 2 (each rank's experts cut to its TP columns/rows), and on 2
  ranks at EP=1 x DP=2 and EP=2 x expert-DP 1.

The state of a ZeRO-1 run is rebuilt here from the optimizers' own shards (nxd_optim's public
``dtype_buckets``: each bucket's params end to end, rank r holding the r-th slice), the expert
rows of each EP rank stacked in EP order, independently of nxd-ckpt's code. Loaded values are
bytes copied from the saved ones (same dtypes), so every comparison is exact (rtol=atol=0).
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
LR, SAVED_LR = 1e-2, 3e-3
EXACT = {"rtol": 0.0, "atol": 0.0}  # bytes copied: no arithmetic between save and load
EXPERT_PARAMS = ("moe.expert_mlps.gate_up_proj.weight", "moe.expert_mlps.down_proj.weight")


class DenseThenMoE(nn.Module):
    """x -> Linear(8, 8) -> MoE (top-2 of 4 gated-SiLU experts, dropless)."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        super().__init__()
        from nxd_layers.moe import ExpertMLPsCapacityFactor, MoE, RouterTopK

        torch.manual_seed(seed)  # experts drawn full and sliced: the same at any EP degree
        self.dense = nn.Linear(HIDDEN, HIDDEN, dtype=dtype)
        router = RouterTopK(EXPERTS, TOP_K, HIDDEN, dtype=dtype)
        mlps = ExpertMLPsCapacityFactor(
            EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", None, True, dtype=dtype
        )
        self.moe = MoE(router, mlps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe(self.dense(x))[0]
        return out


def _build(
    ep: int, zero1: bool, seed: int, dtype: torch.dtype, tp: int = 1, cp: int = 1
) -> tuple[nn.Module, Any]:
    """(model, NxDOptimizer) at EP=``ep``, TP=``tp``, CP=``cp`` over every rank
    (re-initialises the state; the experts' intermediate dim is split over TP)."""
    import nxd_state
    from nxd_optim import MixedPrecisionConfig, NxDOptimizer, OptimizerConfig

    if nxd_state.model_parallel_is_initialized():
        nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, context_parallel_size=cp
    )
    model = DenseThenMoE(seed, dtype)
    config = OptimizerConfig(zero_one_enabled=zero1)
    mixed = MixedPrecisionConfig(
        use_master_weights=True, use_fp32_grad_acc=False, use_master_weights_in_ckpt=True
    )
    return model, NxDOptimizer(
        model.parameters(), torch.optim.AdamW, config=config, mixed_precision=mixed, lr=LR
    )


def _train(model: nn.Module, optimizer: Any, steps: int, seed: int, dtype: torch.dtype) -> None:
    """``steps`` AdamW steps of mean-squared error on this rank's rows of a fixed batch."""
    import nxd_state

    gen = torch.Generator().manual_seed(seed + 100 * nxd_state.get_data_parallel_rank())
    for _ in range(steps):
        x = torch.randn(ROWS, SEQ, HIDDEN, generator=gen).to(dtype)
        target = torch.randn(ROWS, SEQ, HIDDEN, generator=gen).to(dtype)
        optimizer.zero_grad()
        ((model(x) - target) ** 2).mean().backward()
        optimizer.step()


def _zeros(core: Any) -> list[Any]:
    """The ZeRO-1 optimizers holding flat shards: the halves of an EP-aware one, or itself."""
    from nxd_optim import NeuronEPZero1Optimizer, NeuronZero1Optimizer

    if isinstance(core, NeuronEPZero1Optimizer):
        return [h for h in (core.non_ep_zero_optimizer, core.ep_zero_optimizer) if h]
    return [core] if isinstance(core, NeuronZero1Optimizer) else []


def _lrs(optimizer: Any) -> list[float]:
    """The LR of every param group: the caller's and each ZeRO-1 half's (a step copies the
    caller's into the halves, then each half's into its inner optimizer)."""
    core = optimizer.optimizer
    holders = [core, *[z for z in _zeros(core) if z is not core]]
    return [float(g["lr"]) for h in holders for g in h.param_groups]


def _snapshot(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's parameters and optimizer state, raw: ZeRO-1 flat shards per bucket (with
    its group's sharding rank and size) or a plain optimizer's per-parameter state."""
    import nxd_state

    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {
        "ep_rank": nxd_state.get_expert_model_parallel_rank(),
        "tp_rank": nxd_state.get_tensor_model_parallel_rank(),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "lrs": _lrs(optimizer),
    }
    core = optimizer.optimizer
    zeros = _zeros(core)
    if zeros:
        expert_half = getattr(core, "ep_zero_optimizer", None)
        out["zero"] = []
        for half in zeros:
            for bucket in half.dtype_buckets:
                params = bucket.params(half.param_groups[bucket.group_index]["params"])
                state = half.base_optimizer.state[bucket.master]
                out["zero"].append(
                    {
                        "expert_half": half is expert_half,
                        "names": [names[id(p)] for p in params],
                        "shapes": [tuple(p.shape) for p in params],
                        "rank": half.sharding_rank,
                        "size": half.sharding_size,
                        "flat": {
                            "master": bucket.master.detach().clone(),
                            **{k: v.clone() for k, v in state.items() if v.dim() == 1},
                        },
                        "scalars": {k: v.clone() for k, v in state.items() if v.dim() == 0},
                    }
                )
        return out
    masters = optimizer.master_weights_by_param()
    plain = {}
    for name, param in model.named_parameters():
        stepped = masters.get(param, param)
        entry = {k: v.clone() for k, v in optimizer.optimizer.state[stepped].items()}
        entry["master"] = stepped.detach().clone()  # the weights the optimizer steps
        plain[name] = entry
    out["plain"] = plain
    return out


def _stack_experts(by_ep: dict[int, dict[str, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    """Expert tensors of each EP rank (rows [q E/EP, (q+1) E/EP)) stacked in EP order."""
    ranks = sorted(by_ep)
    assert ranks == list(range(len(ranks)))
    full = {}
    for name, entry in by_ep[0].items():
        full[name] = {
            key: torch.cat([by_ep[q][name][key] for q in ranks])
            if name in EXPERT_PARAMS and value.dim() > 0
            else value
            for key, value in entry.items()
        }
    return full


Coord = tuple[int, int]  # (EP rank, TP rank)


def _zero_state(snapshots: list[dict[str, Any]]) -> dict[Coord, dict[str, dict[str, Any]]]:
    """{(EP rank, TP rank): {name: {key: local tensor}}} rebuilt from every rank's ZeRO-1
    shards: a bucket's shards concatenated in sharding-rank order are its params end to end
    (then padding). Dense buckets belong to every EP rank; ranks holding the same shard (TP
    replicas of a dense bucket) must agree."""
    buckets: dict[tuple[int, int, tuple[str, ...]], dict[str, Any]] = {}
    for snap in snapshots:
        for bucket in snap["zero"]:
            owner = snap["ep_rank"] if bucket["expert_half"] else -1
            key = (owner, snap["tp_rank"], tuple(bucket["names"]))
            got = buckets.setdefault(key, {**bucket, "shards": {}})
            if bucket["rank"] in got["shards"]:
                for k, value in bucket["flat"].items():
                    torch.testing.assert_close(value, got["shards"][bucket["rank"]][k], **EXACT)
            got["shards"][bucket["rank"]] = bucket["flat"]
    local: dict[Coord, dict[str, dict[str, Any]]] = {}
    ep_ranks = sorted({snap["ep_rank"] for snap in snapshots})
    for (owner, tp_rank, names), got in buckets.items():
        assert sorted(got["shards"]) == list(range(got["size"])), "a shard is missing"
        for key in got["flat"]:
            flat = torch.cat([got["shards"][r][key] for r in range(got["size"])])
            offset = 0
            for name, shape in zip(names, got["shapes"]):
                numel = int(torch.Size(shape).numel())
                value = flat[offset : offset + numel].view(shape)
                offset += numel
                for q in ep_ranks if owner < 0 else [owner]:
                    entry = local.setdefault((q, tp_rank), {}).setdefault(name, {})
                    entry[key] = value
                    entry.update(got["scalars"])
    return local


def _local_states(snapshots: list[dict[str, Any]]) -> dict[Coord, dict[str, dict[str, Any]]]:
    """{(EP rank, TP rank): {name: {"param", "master", "exp_avg", "exp_avg_sq", "step"}}}
    from the snapshots of one layout; the replicas of every parameter must agree."""
    params: dict[Coord, dict[str, dict[str, torch.Tensor]]] = {}
    state: dict[Coord, dict[str, dict[str, Any]]] = {}
    for snap in snapshots:
        coord = (snap["ep_rank"], snap["tp_rank"])
        first = params.setdefault(coord, {n: {"param": p} for n, p in snap["params"].items()})
        for name, value in snap["params"].items():
            torch.testing.assert_close(value, first[name]["param"], **EXACT)
        if "plain" in snap:
            kept = state.setdefault(coord, snap["plain"])
            for name, entry in snap["plain"].items():
                for key, value in entry.items():
                    torch.testing.assert_close(value, kept[name][key], **EXACT)
    if "zero" in snapshots[0]:
        state = _zero_state(snapshots)
    return {c: {n: {**params[c][n], **state[c][n]} for n in params[c]} for c in params}


def _full_state(snapshots: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """The state of a TP=1 layout with all experts (each EP rank's stacked in EP order)."""
    local = _local_states(snapshots)
    assert {tp for _, tp in local} == {0}
    return _stack_experts({ep: entry for (ep, _), entry in local.items()})


def _assert_same(loaded: dict[str, Any], saved: dict[str, Any], what: str) -> None:
    assert set(loaded) == set(saved), what
    for name, entry in saved.items():
        assert set(loaded[name]) == set(entry), f"{what}: {name}"
        for key, value in entry.items():
            torch.testing.assert_close(
                loaded[name][key], value, **EXACT, msg=f"{what}: {name}/{key}"
            )


def _save_ep2(path: str, zero1: bool, dtype: torch.dtype) -> tuple[nn.Module, Any, dict]:
    model, optimizer = _build(2, zero1, 0, dtype)  # DP=4: expert-DP groups of 2
    _train(model, optimizer, STEPS, 11, dtype)
    for group in optimizer.param_groups:
        group["lr"] = SAVED_LR  # an LR scheduler's edit: must come back
    save_checkpoint(path, "ep2", model=model, optimizer=optimizer)
    return model, optimizer, _snapshot(model, optimizer)


def _ep2_zero1_save_and_loads(path: str, dtype: torch.dtype) -> dict[str, Any]:
    model, optimizer, saved = _save_ep2(path, True, dtype)
    out: dict[str, Any] = {"saved": saved}
    fresh, fresh_optimizer = _build(2, True, 1, dtype)  # other weights, empty state
    load_checkpoint(path, "ep2", model=fresh, optimizer=fresh_optimizer)
    out["ep2"] = _snapshot(fresh, fresh_optimizer)
    # Resuming: one more step from the saved run and from the loaded one, same batch.
    _train(model, optimizer, 1, 99, dtype)
    _train(fresh, fresh_optimizer, 1, 99, dtype)
    out["next"] = (_snapshot(model, optimizer), _snapshot(fresh, fresh_optimizer))
    for ep, key in ((4, "ep4"), (1, "ep1")):  # EP=4 x expert-DP 1; plain ZeRO-1 over DP=4
        fresh, fresh_optimizer = _build(ep, True, 2, dtype)
        load_checkpoint(path, "ep2", model=fresh, optimizer=fresh_optimizer)
        out[key] = _snapshot(fresh, fresh_optimizer)
    return out


def _load_at(path: str, ep: int, zero1: bool, dtype: torch.dtype) -> dict[str, Any]:
    model, optimizer = _build(ep, zero1, 3, dtype)
    load_checkpoint(path, "ep2", model=model, optimizer=optimizer)
    return _snapshot(model, optimizer)


def _check_tiled_once(tag_dir: Path) -> None:
    """Across every rank's manifest each (tensor, box) is written once, and the chunks of
    each optimizer tensor tile it (their volumes sum to its size); the expert state is
    declared with all experts (dim 0 = EXPERTS)."""
    (data,) = tag_dir.glob("data-*")
    written: list[tuple[str, str, tuple[int, ...]]] = []
    for manifest in sorted(data.glob("manifest_rank_*.json")):
        for chunk in json.loads(manifest.read_text())["chunks"]:
            written.append((chunk["category"], chunk["name"], tuple(chunk["offsets"])))
    kept = [w for w in written if w[0] in ("model", "optimizer")]
    assert len(kept) == len(set(kept)), "a box was written twice"
    index = json.loads((tag_dir / "index.json").read_text())
    optimizer = index["tensors"]["optimizer"]
    for name, record in optimizer.items():
        volume = sum(int(torch.Size(c["shape"]).numel()) for c in record["chunks"])
        assert volume == torch.Size(record["shape"]).numel(), name
    for name in EXPERT_PARAMS:
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert optimizer[f"{name}/{key}"]["shape"][0] == EXPERTS
    assert index["optimizer"]["zero1"] is True
    assert index["parallel"]["expert_model_parallel_size"] == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ep_zero1_reloads_at_ep2_ep4_ep1_and_without_zero1(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    results = run_distributed(_ep2_zero1_save_and_loads, 4, str(tmp_path), dtype)
    _check_tiled_once(tmp_path / "ep2")
    saved = _full_state([r["saved"] for r in results])
    if dtype == torch.bfloat16:  # fp32 masters of bf16 params, fp32 moments
        assert saved["dense.weight"]["master"].dtype == torch.float32
        assert saved["dense.weight"]["exp_avg"].dtype == torch.float32
    for key in ("ep2", "ep4", "ep1"):
        _assert_same(_full_state([r[key] for r in results]), saved, key)
        assert all(set(r[key]["lrs"]) == {SAVED_LR} for r in results), key
    for before, after in (r["next"] for r in results):  # the resumed step: bit for bit
        for name, value in before["params"].items():
            torch.testing.assert_close(after["params"][name], value, **EXACT, msg=name)
    _assert_same(
        _full_state([r["next"][1] for r in results]),
        _full_state([r["next"][0] for r in results]),
        "resumed step",
    )
    (one,) = run_distributed(_load_at, 1, str(tmp_path), 1, False, dtype)
    _assert_same(_full_state([one]), saved, "one process, no ZeRO-1")
    assert set(one["lrs"]) == {SAVED_LR}


def _plain_ep2_then_ep_zero1(path: str) -> dict[str, Any]:
    _, _, saved = _save_ep2(path, False, torch.float64)
    return {"saved": saved, "loaded": _load_at(path, 2, True, torch.float64)}


def test_plain_ep2_checkpoint_loads_into_ep_zero1(tmp_path: Path) -> None:
    results = run_distributed(_plain_ep2_then_ep_zero1, 4, str(tmp_path))
    assert all("zero" in r["loaded"] for r in results)  # the EP-aware ZeRO-1 loaded it
    saved = _full_state([r["saved"] for r in results])
    _assert_same(_full_state([r["loaded"] for r in results]), saved, "EP-ZeRO-1 from plain")
    assert all(set(r["loaded"]["lrs"]) == {SAVED_LR} for r in results)


def _cp2_save_then_dp4_load(path: str) -> dict[str, Any]:
    model, optimizer = _build(2, True, 0, torch.float64, cp=2)  # DP 2 x CP 2: expert-DP 2
    _train(model, optimizer, STEPS, 11, torch.float64)
    save_checkpoint(path, "cp2", model=model, optimizer=optimizer)
    saved = _snapshot(model, optimizer)
    fresh, fresh_optimizer = _build(2, True, 1, torch.float64)  # DP 4, no CP
    load_checkpoint(path, "cp2", model=fresh, optimizer=fresh_optimizer)
    return {"saved": saved, "loaded": _snapshot(fresh, fresh_optimizer)}


def test_ep_zero1_over_dp_x_cp_reloads_without_cp(tmp_path: Path) -> None:
    """Expert-DP spans CP (DP 2 x CP 2 at EP=2): the halves' shards are cut over DP x CP and
    over expert-DP x CP ranks, and reload at DP=4 without CP."""
    results = run_distributed(_cp2_save_then_dp4_load, 4, str(tmp_path))
    saved = _full_state([r["saved"] for r in results])
    _assert_same(_full_state([r["loaded"] for r in results]), saved, "DP 2 x CP 2 -> DP 4")


def _save_only(path: str, dtype: torch.dtype) -> dict[str, Any]:
    return _save_ep2(path, True, dtype)[2]


def _loads_at(path: str, eps: list[int], dtype: torch.dtype) -> list[dict[str, Any]]:
    return [_load_at(path, ep, True, dtype) for ep in eps]


@pytest.mark.slow
def test_ep_zero1_reloads_on_8_and_2_ranks(tmp_path: Path) -> None:
    dtype = torch.bfloat16
    saved = _full_state(run_distributed(_save_only, 4, str(tmp_path), dtype))
    for world, eps in ((8, [4, 2]), (2, [1, 2])):  # expert-DP 2 and 4; DP=2 and expert-DP 1
        results = run_distributed(_loads_at, world, str(tmp_path), eps, dtype)
        for position, ep in enumerate(eps):
            loaded = _full_state([r[position] for r in results])
            _assert_same(loaded, saved, f"world {world}, EP={ep}")


def _tp_cut(name: str, value: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The TP rank's part of an (experts, …) tensor (experts.py's split): columns ``t`` of
    the gate and of the up halves of ``gate_up_proj``, rows ``t`` of ``down_proj``."""
    width = INTERMEDIATE // 2
    mine = torch.arange(tp_rank * width, (tp_rank + 1) * width)
    if name.endswith("gate_up_proj.weight"):
        return value[:, :, torch.cat([mine, mine + INTERMEDIATE])]
    return value[:, mine]


def _tp2_load(path: str, dtype: torch.dtype) -> dict[str, Any]:
    model, optimizer = _build(2, True, 3, dtype, tp=2)  # 8 ranks: DP=4, expert-DP 2
    load_checkpoint(path, "ep2", model=model, optimizer=optimizer)
    return _snapshot(model, optimizer)


@pytest.mark.slow
def test_ep_zero1_reloads_at_tp2_inside_the_experts(tmp_path: Path) -> None:
    dtype = torch.bfloat16
    saved = _full_state(run_distributed(_save_only, 4, str(tmp_path), dtype))
    local = _local_states(run_distributed(_tp2_load, 8, str(tmp_path), dtype))
    assert sorted(local) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    rows = EXPERTS // 2
    for (ep, tp), state in local.items():  # each rank's experts and TP columns/rows
        expected = {
            name: {
                key: _tp_cut(name, value[ep * rows : (ep + 1) * rows], tp)
                if name in EXPERT_PARAMS and value.dim() > 0
                else value
                for key, value in entry.items()
            }
            for name, entry in saved.items()
        }
        _assert_same(state, expected, f"EP rank {ep}, TP rank {tp}")
