"""Resume a Hugging Face model at another (TP, PP) degree, through the trainer API.

The tiny Llama (4 heads, 2 KV heads) is parallelised by ``initialize_parallel_model`` as
``nxd-train`` does: separate Q/K/V column-parallel layers at TP 1 and 2, the GQA projection
(K/V heads replicated, ``weight_q/k/v``, or one ``weight_qkv`` with ``fuse_qkv``) at TP 4. A
layout ("tp4pp1f": TP 4, PP 1, fused; "z": ZeRO-1 over DP 2; "L": saved as checkpoints were
before the GQA projection declared its stored names, i.e. under ``qkv_proj.weight_*``) trains
one AdamW step (clipping at 0.5) and saves with ``nxd_trainer.save_checkpoint``; every other
layout loads it with ``nxd_trainer.load_checkpoint`` and steps once. Checked:

* the loaded parameters, gathered to the Hugging Face names and shapes by hand (K/V replicas
  must be equal, the first is kept; a fused tensor is cut per rank into Q, K, V), equal the
  saved ones **bitwise** (a load copies stored bytes; nothing is recomputed);
* the loss of the step after loading, and every parameter after it (which uses the loaded
  Adam moments and step count), equal the uninterrupted one-process run of the unmodified
  model: rtol 1e-4 / atol 1e-5, as ``test_hf_trainer.py``: TP splits the matmul sums, so
  parameters differ by fp32 re-association, which AdamW's first steps amplify up to ~lr·1e-3
  where a gradient is near ``eps`` (a wrong or missing moment moves a parameter by ~lr = 1e-2);
* the saved parameters and the first loss match the one-process run likewise.

CI runs a representative subset (TP4→TP2, TP2→TP4, TP4→TP4 fused and unfused and across,
TP2×PP2→TP4, TP1→TP4×PP2, ZeRO-1 over DP 2 with the fused projection both ways, and the
older ``qkv_proj`` names at TP 4 and TP 2); ``-m slow`` runs every (TP, PP) in {1, 2, 4} x
{1, 2} (TP 4 fused and not) from and to every other. Below transformers 5.20.2 (the `lowest`
session) the PP > 1 layouts are left out: such a model cannot be captured into stages there
(``_hf.PIPELINE_FIRST_GOOD_TRANSFORMERS``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
TOL = {"rtol": 1e-4, "atol": 1e-5}
EXACT = {"rtol": 0.0, "atol": 0.0}
ADAMW = {"lr": 1e-2, "eps": 1e-4}
MAX_NORM = 0.5
TAG = "step1"
SEEDS = (40, 41)  # the batches of steps 1 and 2
_LAYOUT = re.compile(r"tp(\d)pp(\d)(f?)(z?)(L?)")


def _parse(setup: str) -> tuple[int, int, bool, bool, bool]:
    match = _LAYOUT.fullmatch(setup)
    assert match is not None, setup
    tp, pp, fused, zero1, legacy = match.groups()
    return int(tp), int(pp), bool(fused), bool(zero1), bool(legacy)


def world(setup: str) -> int:
    tp, pp, _, zero1, _ = _parse(setup)
    return tp * pp * (2 if zero1 else 1)


@contextlib.contextmanager
def _qkv_layout(fused: bool) -> Iterator[None]:
    """Llama's parallelizer with ``fuse_qkv`` while the model is built."""
    from nxd_trainer.hf import LlamaParallelizer, ParallelizersManager

    if not fused:
        yield
        return

    class FusedLlamaParallelizer(LlamaParallelizer):
        fuse_qkv = True

    ParallelizersManager.register(FusedLlamaParallelizer)
    try:
        yield
    finally:
        ParallelizersManager.register(LlamaParallelizer)


def _build(setup: str) -> tuple[Any, Any]:
    import nxd_state
    import nxd_trainer as nxd

    tp, pp, fused, zero1, _ = _parse(setup)
    nxd_state.destroy_model_parallel()
    pipeline_config = None
    if pp > 1:
        pipeline_config = {
            "num_microbatches": 2,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["model.layers.0"],
        }
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline_config,
        optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": MAX_NORM},
    )
    with _qkv_layout(fused):
        model = nxd.initialize_parallel_model(config, lambda: H.model("llama"))
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.AdamW, model.parameters(), **ADAMW
    )
    return model, optimizer


def _step(model: Any, optimizer: Any, seed: int) -> float | None:
    """One step on this DP rank's rows of the batch; the loss averaged over DP (last stage)."""
    import nxd_state
    from nxd_state import collectives

    dp, rank = nxd_state.get_data_parallel_size(), nxd_state.get_data_parallel_rank()
    ids = H.batch(seed=seed)
    rows = ids.shape[0] // dp
    ids = ids[rank * rows : (rank + 1) * rows]
    loss = model.run_train(input_ids=ids, labels=ids)
    optimizer.step()
    optimizer.zero_grad()
    if loss is None:
        return None
    total = torch.tensor([float(loss)], dtype=torch.float64)
    collectives.all_reduce(total, group=nxd_state.get_data_parallel_group())
    return total.item() / dp


def _hf_name(name: str) -> str:
    """The Hugging Face name of a parallel tensor (written here, not the parallelizer's)."""
    match = re.fullmatch(r"(.*)\.qkv_proj\.(weight|bias)_([qkv])", name)
    return f"{match[1]}.{match[3]}_proj.{match[2]}" if match else name


def _dereplicate(full: torch.Tensor, kv_rows: int) -> torch.Tensor:
    """K or V gathered with each head replicated m times in a row: the first copies (all
    copies must be equal)."""
    m = full.shape[0] // kv_rows
    if m == 1:
        return full
    cfg = H.config("llama")
    kv = cfg.num_key_value_heads
    copies = full.reshape(kv, m, -1, *full.shape[1:])
    for copy in range(1, m):
        torch.testing.assert_close(copies[:, copy], copies[:, 0], **EXACT)
    return copies[:, 0].reshape(-1, *full.shape[1:])


def gathered(model: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters, gathered over TP, under the Hugging Face names and shapes."""
    import nxd_state
    from nxd_layers import full_tensor

    cfg = H.config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q_rows, kv_rows = cfg.hidden_size, cfg.num_key_value_heads * head_dim
    tp = nxd_state.get_tensor_model_parallel_size()
    out = {}
    for name, param in model.named_parameters():
        fused = re.fullmatch(r"(.*)\.qkv_proj\.(weight|bias)_qkv", name)
        if fused is None:
            out[_hf_name(name)] = H.full(param, param.detach(), name, cfg).clone()
            continue
        full = full_tensor(param, param.detach())  # rank 0's [Q; K; V] rows, rank 1's ...
        per_rank = full.reshape(tp, -1, *full.shape[1:])
        local_kv = (per_rank.shape[1] - q_rows // tp) // 2
        q, k, v = (
            torch.cat(list(piece), dim=0)
            for piece in per_rank.split([q_rows // tp, local_kv, local_kv], dim=1)
        )
        prefix, kind = fused[1], fused[2]
        out[f"{prefix}.q_proj.{kind}"] = q.clone()
        out[f"{prefix}.k_proj.{kind}"] = _dereplicate(k, kv_rows).clone()
        out[f"{prefix}.v_proj.{kind}"] = _dereplicate(v, kv_rows).clone()
    return out


def _drop_declarations(model: Any) -> None:
    """What checkpoints were before the GQA projection declared its stored names."""
    from nxd_ckpt import CHECKPOINT_PARTS
    from nxd_layers import GQAQKVColumnParallelLinear

    dropped = 0
    for module in model.modules():
        if isinstance(module, GQAQKVColumnParallelLinear):
            delattr(module, CHECKPOINT_PARTS)
            dropped += 1
    assert dropped, "no GQA projection to save the old way"


def run_plan(root: str, saves: list[str], targets: list[tuple[str, list[str]]]) -> dict:
    """Train one step and save each of ``saves``; then build each target and, per source,
    load it, gather, step once and gather again."""
    import nxd_trainer as nxd

    out: dict[str, Any] = {"saved": {}, "resumed": {}}
    for setup in saves:
        model, optimizer = _build(setup)
        loss = _step(model, optimizer, SEEDS[0])
        if _parse(setup)[4]:
            _drop_declarations(model)
        nxd.save_checkpoint(Path(root) / setup, TAG, model=model, optimizer=optimizer)
        out["saved"][setup] = {"loss": loss, "params": gathered(model)}
    for target, sources in targets:
        model, optimizer = _build(target)
        for source in sources:
            nxd.load_checkpoint(Path(root) / source, TAG, model=model, optimizer=optimizer)
            loaded = gathered(model)
            loss = _step(model, optimizer, SEEDS[1])
            out["resumed"][(source, target)] = {
                "loaded": loaded,
                "loss": loss,
                "params": gathered(model),
            }
    return out


def _reference() -> dict[str, Any]:
    """The uninterrupted one-process run of the unmodified model."""
    model = H.model("llama")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    out: dict[str, Any] = {"losses": [], "params": []}
    for seed in SEEDS:
        ids = H.batch(seed=seed)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' results as one: parameters by name (each rank holds its stage's, every TP
    rank the same gathered ones), the loss of the last stage."""
    merged: dict[str, Any] = {"saved": {}, "resumed": {}}
    for kind in ("saved", "resumed"):
        for result in results:
            for key, entry in result[kind].items():
                into = merged[kind].setdefault(key, {"loss": None})
                for field, value in entry.items():
                    if field == "loss":
                        into["loss"] = value if value is not None else into["loss"]
                    else:
                        into.setdefault(field, {}).update(value)
    return merged


Plan = list[tuple[list[str], list[tuple[str, list[str]]]]]


def _capturable(plan: Plan) -> Plan:
    """``plan`` without its PP > 1 layouts where the installed transformers cannot be captured
    into pipeline stages (``_hf.PIPELINE_FIRST_GOOD_TRANSFORMERS``: the `lowest` session; the
    pipeline's error there is checked by test_hf_pipeline.py)."""
    if H.pipeline_capture_works():
        return plan

    def flat(setup: str) -> bool:
        return _parse(setup)[1] == 1

    kept: Plan = []
    for saves, targets in plan:
        kept_targets = [
            (target, [source for source in sources if flat(source)])
            for target, sources in targets
            if flat(target) and any(flat(source) for source in sources)
        ]
        kept.append(([setup for setup in saves if flat(setup)], kept_targets))
    return [entry for entry in kept if entry[0] or entry[1]]


def _resumes(plan: Plan) -> int:
    return sum(len(targets) for _, entry in plan for _, targets in entry)


def _check(root: Path, plan: Plan) -> int:
    """Run ``plan`` (one ``run_distributed`` per entry, in order) and check every resume."""
    reference = _reference()
    names = set(reference["params"][0])
    saved: dict[str, Any] = {}
    checked = 0
    for saves, targets in plan:
        worlds = {world(s) for s in saves} | {world(t) for t, _ in targets}
        assert len(worlds) == 1, plan
        result = _merge(run_distributed(run_plan, worlds.pop(), str(root), saves, targets))
        for setup, entry in result["saved"].items():
            assert set(entry["params"]) == names, setup
            torch.testing.assert_close(entry["loss"], reference["losses"][0], **TOL)
            for name, value in entry["params"].items():
                expected = reference["params"][0][name]
                torch.testing.assert_close(value, expected, **TOL, msg=f"{setup}: {name}")
            saved[setup] = entry["params"]
        for (source, target), entry in result["resumed"].items():
            where = f"{source} -> {target}"
            assert set(entry["loaded"]) == names, where
            for name, value in entry["loaded"].items():
                torch.testing.assert_close(
                    value, saved[source][name], **EXACT, msg=f"{where}: {name} as loaded"
                )
            torch.testing.assert_close(entry["loss"], reference["losses"][1], **TOL, msg=where)
            for name, value in entry["params"].items():
                expected = reference["params"][1][name]
                torch.testing.assert_close(value, expected, **TOL, msg=f"{where}: {name} after")
            checked += 1
    return checked


def test_resume_at_other_degrees(tmp_path: Path) -> None:
    plan = [
        (["tp1pp1"], []),
        (["tp2pp1"], []),
        (
            ["tp4pp1", "tp4pp1f", "tp4pp1L", "tp2pp2"],
            [
                ("tp4pp1", ["tp2pp1", "tp4pp1", "tp4pp1f", "tp2pp2", "tp4pp1L"]),
                ("tp4pp1f", ["tp4pp1f", "tp4pp1", "tp2pp1"]),
            ],
        ),
        (
            ["tp4pp1fz"],
            [("tp4pp2", ["tp1pp1"]), ("tp4pp1fz", ["tp2pp1", "tp4pp1fz", "tp4pp1"])],
        ),
        ([], [("tp2pp1", ["tp4pp1", "tp4pp1f", "tp4pp1L", "tp4pp1fz"])]),
    ]
    assert _resumes(plan) == 16
    plan = _capturable(plan)
    assert _check(tmp_path, plan) == _resumes(plan)


@pytest.mark.slow
def test_resume_matrix_every_degree(tmp_path: Path) -> None:
    layouts = ["tp1pp1", "tp2pp1", "tp1pp2", "tp4pp1", "tp4pp1f", "tp2pp2", "tp4pp2", "tp4pp2f"]
    by_world: dict[int, list[str]] = {}
    for layout in layouts:
        by_world.setdefault(world(layout), []).append(layout)
    plan: Plan = [(by_world[w], []) for w in (1, 2, 4, 8)]
    plan += [([], [(t, layouts) for t in by_world[w]]) for w in (1, 2, 4, 8)]
    assert _resumes(plan) == len(layouts) ** 2
    plan = _capturable(plan)
    assert _check(tmp_path, plan) == _resumes(plan)
