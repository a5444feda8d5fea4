"""★ NxD's own checkpoint layout: written here with ``torch.save`` exactly as NxD lays it out,
read back with ``torch.load(weights_only=True)`` only, resharded, and converted.

A tiny GPT trains 2 steps at TP=2 (2 gloo ranks, AdamW) and writes three NxD-layout tags:

* ``plain``: ``model/dp_rank_00_tp_rank_0t_pp_rank_00.pt`` (the rank's state dict) and
  ``optim/…`` (the optimizer's state dict), ``user_content.pt`` and the markers;
* ``xser``: the model files as torch-xla serialization writes them: a pickled structure of
  ``TensorReference(tid)`` (written through a stand-in module named like torch-xla's) and one
  ``<file>.tensors/tensor_<tid>.pt`` per tensor;
* ``zero1``: optimizer files as torch-xla's ZeRO-1 writes them at DP=2: per parameter,
  ``base_state`` shards of the dim-0-padded state, and ``shape_info``.

Loading any of them at TP=1 gives back the saved parameters bitwise, and training goes on
within fp32 rounding of the run that never stopped (TP=2 -> TP=1 reassociates the sums: see
test_reshard.py for the tolerance). ``convert-nxd`` writes the same weights in this format;
user content (a pickle) is read only with ``allow_pickle=True``.
"""

from __future__ import annotations

import json
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from nxd_ckpt import load_checkpoint
from nxd_ckpt.cli import main as cli
from nxd_ckpt.testing import Degrees, build, full_state, train_step
from nxd_state.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}  # as in test_reshard.py


def _xser_save(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` the way torch-xla's xser does, without torch-xla."""
    module = types.ModuleType("torch_xla.utils.serialization")

    class TensorReference:
        def __init__(self, tid: int) -> None:
            self.tid = tid

    TensorReference.__module__ = module.__name__
    TensorReference.__qualname__ = "TensorReference"
    module.TensorReference = TensorReference
    names = ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization")
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = module if name == names[-1] else types.ModuleType(name)
    try:
        folder = path.with_name(path.name + ".tensors")
        folder.mkdir()
        refs = {}
        for tid, (name, tensor) in enumerate(state.items()):
            torch.save(tensor.clone(), folder / f"tensor_{tid}.pt")
            refs[name] = TensorReference(tid)
        torch.save(refs, path)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def _zero1_files(state: dict, dp: int) -> list[dict]:
    """torch-xla ZeRO-1 optimizer state dicts of ``dp`` ranks, from a plain state dict."""
    out = []
    for rank in range(dp):
        base, shapes = {}, {}
        for position, entry in state["state"].items():
            shape = entry["exp_avg"].shape
            shapes[position] = torch.Size(shape)
            base[position] = {"step": entry["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                value = entry[key]
                pad = -shape[0] % dp
                padded = torch.cat([value, value.new_zeros(pad, *shape[1:])]) if pad else value
                base[position][key] = padded.chunk(dp)[rank].clone()
        out.append(
            {
                "state": {},
                "param_groups": state["param_groups"],
                "base_state": base,
                "shape_info": shapes,
            }
        )
    return out


def write_nxd_layout(path: str) -> dict[str, dict[str, torch.Tensor]]:
    import nxd_state

    model, optimizer = build(Degrees(tp=2))
    for step in (0, 1):
        train_step(model, optimizer, step)
    saved = full_state(model)
    rank = nxd_state.get_parallel_state().tensor_parallel_rank
    name = f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt"
    root = Path(path)
    for tag in ("plain", "xser", "zero1"):
        for sub in ("model", "optim"):
            (root / tag / sub).mkdir(parents=True, exist_ok=True)
        for marker in ("checkpoint", "done"):
            (root / tag / marker).write_text("1")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim_state = optimizer.state_dict()
    torch.save(state, root / "plain" / "model" / name)
    torch.save(optim_state, root / "plain" / "optim" / name)
    _xser_save(state, root / "xser" / "model" / name)
    torch.save(state, root / "zero1" / "model" / name)
    for dp, zero in enumerate(_zero1_files(optim_state, 2)):
        torch.save(
            zero, root / "zero1" / "optim" / f"dp_rank_{dp:02d}_tp_rank_{rank:02d}_pp_rank_00.pt"
        )
    if rank == 0:
        torch.save({"step": 2}, root / "plain" / "user_content.pt")
    train_step(model, optimizer, 2)
    return {"saved": saved, "continued": full_state(model)}


def load_at_tp1(path: str, tag: str, with_optimizer: bool, allow_pickle: bool) -> dict:
    model, optimizer = build(Degrees(tp=1), seed=99)
    content = load_checkpoint(
        path,
        tag,
        model=model,
        optimizer=optimizer if with_optimizer else None,
        allow_pickle=allow_pickle,
    )
    loaded = full_state(model)
    train_step(model, optimizer, 2)
    return {"loaded": loaded, "continued": full_state(model), "content": content}


def _compare(got: dict, want: dict, label: str, **tol: float) -> None:
    assert got.keys() == want.keys(), label
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=f"{label}: {name}")


def test_nxd_layouts_load_reshard_and_convert(tmp_path: Path) -> None:
    path = str(tmp_path / "nxd")
    written = run_distributed(write_nxd_layout, 2, path)
    saved, continued = written[0]["saved"], written[0]["continued"]
    exact = {"rtol": 0.0, "atol": 0.0}
    for tag, optim, pickles in (
        ("plain", True, True),
        ("zero1", True, False),
        ("xser", False, False),
    ):
        result = run_distributed(load_at_tp1, 1, path, tag, optim, pickles)[0]
        _compare(result["loaded"], saved, f"{tag} loaded", **exact)
        if optim:  # the optimizer state came along: training continues as before
            _compare(result["continued"], continued, f"{tag} continued", **TOL)
        assert result["content"] == ({"step": 2} if pickles else None)

    out = tmp_path / "converted"
    rules = tmp_path / "rules.json"  # TinyGPT's column (dim 0) and row (dim 1) layers
    rules.write_text(
        json.dumps(
            [[r"(q_proj|k_proj|v_proj|fc)\.(weight|bias)$", 0], [r"(o_proj|out)\.weight$", 1]]
        )
    )
    source = str(tmp_path / "nxd" / "plain")
    assert cli(["convert-nxd", source, str(out), "--rules", str(rules)]) == 0
    plain = build_plain_tp1()
    load_checkpoint(out, "plain", model=plain)
    for name, value in plain.named_parameters():
        torch.testing.assert_close(value.detach(), saved[name], **exact, msg=name)


def build_plain_tp1() -> nn.Module:
    from nxd_pipeline.testing import TinyGPT

    return TinyGPT(vocab=64, hidden=32, layers=4, heads=4)


def test_pickles_are_read_only_when_allowed(tmp_path: Path) -> None:
    marker = tmp_path / "executed"

    class Bomb:
        def __reduce__(self):
            return (Path.write_text, (marker, "boom"))

    tag = tmp_path / "t"
    (tag / "model").mkdir(parents=True)
    model = nn.Linear(3, 2)
    torch.save(model.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    (tag / "user_content.pt").write_bytes(pickle.dumps(Bomb()))
    (tag / "scheduler.pt").write_bytes(pickle.dumps(Bomb()))
    for name in ("checkpoint", "done"):
        (tag / name).write_text("1")
    target = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match=r"user_content\.pt was NOT read.*allow_pickle=True"):
        assert load_checkpoint(tmp_path, "t", model=target) is None
    assert torch.equal(target.weight, model.weight)
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(target.parameters(), 0.1), 1)
    with pytest.raises(PermissionError, match=r"scheduler.pt is a pickle .* allow_pickle=True"):
        load_checkpoint(tmp_path, "t", model=target, scheduler=scheduler)
    assert not marker.exists()
    # A weights file that hides code is refused by torch.load(weights_only=True):
    torch.save({"weight": Bomb()}, tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(tmp_path, "t", model=target)
    assert not marker.exists()
