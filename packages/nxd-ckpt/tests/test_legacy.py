"""NxD's legacy ``parallel_layers.save`` / ``load`` (4 gloo ranks: TP=2 x DP=2).

* ``save`` writes ``tp_rank_XX_pp_rank_YY/checkpoint.safetensors`` (+ JSON structure) from DP
  rank 0 only (every DP rank with ``master_dp_only=False``), serially or not; ``load`` gives
  the model back bitwise and returns the rest of the checkpoint; ``down_cast_bf16`` stores bf16.
* NxD's own pickled ``tp_rank_XX_pp_rank_YY/checkpoint.pt`` loads (``weights_only=True``).
* ``sharded=False``: one unsharded state dict (a safetensors file, a ``.pt`` file with a
  ``model`` entry) loads into the TP=2 model, each rank slicing its shard: the sharded model
  then holds exactly the slices of the full tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nxd_ckpt.legacy import load, save
from nxd_ckpt.testing import Degrees, build, full_state
from nxd_state.testing import run_distributed


def legacy_round_trips(path: str) -> dict:
    import nxd_state

    model, _ = build(Degrees(tp=2, dp=2))
    state = nxd_state.get_parallel_state()
    tp = state.tensor_parallel_rank
    root = Path(path)
    save({"model": model.state_dict(), "epoch": 3}, root / "serial")
    save({"model": model.state_dict()}, root / "parallel", save_serially=False)
    save({"model": model.state_dict()}, root / "bf16", down_cast_bf16=True)
    save({"model": model.state_dict()}, root / "every-dp", master_dp_only=False)
    if state.data_parallel_rank == 0:  # NxD's own pickled layout
        folder = root / "nxd" / f"tp_rank_{tp:02d}_pp_rank_00"
        folder.mkdir(parents=True)
        torch.save({"model": model.state_dict(), "epoch": 4}, folder / "checkpoint.pt")
    torch.distributed.barrier()

    out = {}
    for name in ("serial", "parallel", "nxd"):
        fresh, _ = build(Degrees(tp=2, dp=2), seed=7)
        rest = load(root / name, fresh, model_key="model")
        out[name] = {"rest": rest, "equal": _equal(fresh, model)}
    fresh, _ = build(Degrees(tp=2, dp=2), seed=7)
    load(root / "every-dp", fresh, master_dp_only=False)
    out["every-dp"] = _equal(fresh, model)
    raw = load(root / "bf16")  # no model: the whole checkpoint comes back
    out["bf16 dtypes"] = sorted({str(v.dtype) for v in raw["model"].values()})

    full = full_state(model)  # the unsharded model, as a safetensors file and a .pt file
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, str(root / "full.safetensors"))
        torch.save({"model": full, "step": 9}, root / "full.pt")
    torch.distributed.barrier()
    for name in ("full.safetensors", "full.pt"):
        fresh, _ = build(Degrees(tp=2, dp=2), seed=7)
        rest = load(root / name, fresh, sharded=False)
        out[name] = {"rest": rest, "equal": _equal(fresh, model)}
    return out


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_legacy_save_load(tmp_path: Path) -> None:
    results = run_distributed(legacy_round_trips, 4, str(tmp_path))
    folders = sorted(p.name for p in (tmp_path / "serial").iterdir())
    assert folders == ["tp_rank_00_pp_rank_00", "tp_rank_01_pp_rank_00"]  # DP rank 0 only
    assert sorted(p.name for p in (tmp_path / "serial" / folders[0]).iterdir()) == [
        "checkpoint.json",
        "checkpoint.safetensors",
    ]
    every = sorted(p.name for p in (tmp_path / "every-dp").iterdir())
    assert every == [f"tp_rank_0{t}_pp_rank_00_dp_rank_0{d}" for t in (0, 1) for d in (0, 1)]
    for result in results:
        assert result["serial"] == {"rest": {"epoch": 3}, "equal": True}
        assert result["parallel"] == {"rest": {}, "equal": True}
        assert result["nxd"] == {"rest": {"epoch": 4}, "equal": True}
        assert result["every-dp"] is True
        assert result["bf16 dtypes"] == ["torch.bfloat16"]
        assert result["full.safetensors"] == {"rest": None, "equal": True}
        assert result["full.pt"] == {"rest": {"step": 9}, "equal": True}
