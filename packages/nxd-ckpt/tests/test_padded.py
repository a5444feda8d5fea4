"""Heads padded by ``nxd_layers.pad_model``: stored unpadded, so they reload at other TP degrees.

A block of 3 heads (Column -> GeLU -> Row, plus a gathered Column whose replicated full bias is
padded too) is padded at TP=2 in NxD's per-rank layout (3 -> 4 heads: each rank's shard gets
its zeros), trains one AdamW step and is saved with its optimizer. On 4 gloo ranks (one spawn):

* the index records the unpadded global shape and the padding (``sharding.padding``), and
  the data files hold only the real elements;
* TP=1 (no padding: 3 heads divide) and TP=4 padded the other way (``head_aligned``: whole
  zero heads at the end) load it into parameters scribbled over: every parameter, unpadded,
  equals the saved one bitwise and the padding is zero again; one more AdamW step (Adam
  moments resharded too) equals the step the TP=2 run takes;
* ``export_hf`` writes the unpadded tensors;
* NxD's own layout (each rank's padded state dict, ``torch.save``d as NxD names the files)
  loads into the TP=4 head-aligned model; a checkpoint whose tensors were stored padded
  (saved without the marks, as before padding was recorded) loads into the TP=2 padded model.

Tolerance of the extra step: TP=2 -> 1 or 4 regroups each projection's fp32 sums (rtol 1e-5,
atol 1e-6, as test_reshard.py); the loads themselves are exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}
TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring
HIDDEN, HEADS, HEAD_DIM = 8, 3, 4
WIDTH = HEADS * HEAD_DIM


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from nxd_layers import ColumnParallelLinear, RowParallelLinear

        self.up = ColumnParallelLinear(HIDDEN, WIDTH, gather_output=False)
        self.down = RowParallelLinear(WIDTH, HIDDEN, input_is_parallel=True)
        self.head = ColumnParallelLinear(HIDDEN, WIDTH, gather_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sum of squares: the zero features of the padded widths add nothing.
        return self.down(F.gelu(self.up(x))).square().sum() + self.head(x).square().sum()


def _block(tp: int, seed: int, head_aligned: bool = False) -> tuple[Block, torch.optim.Optimizer]:
    import nxd_state
    from nxd_layers import pad_model

    if nxd_state.model_parallel_is_initialized():
        nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    block = pad_model(Block(), tp, HEADS, head_aligned=head_aligned)
    return block, torch.optim.AdamW(block.parameters(), lr=1e-2)


def _step(block: Block, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(step))
    optimizer.zero_grad()
    block(x).backward()
    optimizer.step()


def _unpadded(block: Block) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor without its padding; checks the padding is zero."""
    from nxd_layers import full_tensor

    out = {}
    for name, param in block.named_parameters():
        full = full_tensor(param)
        padding = getattr(param, "tensor_parallel_padding", None)
        if padding is not None:
            unpadded = padding.unpad(full)
            assert torch.count_nonzero(full).item() == torch.count_nonzero(unpadded).item()
            full = unpadded
        out[name] = full.clone()
    return out


def _scribble(block: Block) -> None:
    """Non-zero everywhere, padding included: a load must write the padding's zeros."""
    with torch.no_grad():
        for param in block.parameters():
            param.fill_(7.0)


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol, label: str) -> None:
    assert got.keys() == want.keys(), label
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tol, msg=f"{label}: {name}")


def padded_round_trips(path: str) -> dict[str, object]:
    import torch.distributed as dist

    import nxd_state

    root = Path(path)
    block, optimizer = _block(2, seed=0)
    _step(block, optimizer, 0)
    saved = _unpadded(block)
    save_checkpoint(root, "tp2", model=block, optimizer=optimizer)
    if nxd_state.get_data_parallel_rank() == 0:  # NxD's layout: each rank's padded state dict
        folder = root / "nxd" / "t" / "model"
        folder.mkdir(parents=True, exist_ok=True)
        tp_rank = nxd_state.get_tensor_model_parallel_rank()
        state = {k: v.detach().clone() for k, v in block.state_dict().items()}
        torch.save(state, folder / f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_00.pt")
        for marker in ("checkpoint", "done"):
            (folder.parent / marker).write_text("1")
    _step(block, optimizer, 1)
    expected = _unpadded(block)
    for param in block.parameters():  # as saved before padding was recorded: padded tensors
        if hasattr(param, "tensor_parallel_padding"):
            del param.tensor_parallel_padding
    save_checkpoint(root, "unmarked", model=block)
    dist.barrier()

    out: dict[str, object] = {}
    for tp, head_aligned in ((1, False), (4, True)):
        block, optimizer = _block(tp, seed=10 + tp, head_aligned=head_aligned)
        _scribble(block)
        load_checkpoint(root, "tp2", model=block, optimizer=optimizer)
        _check(_unpadded(block), saved, EXACT, f"tp{tp} load")
        _step(block, optimizer, 1)
        _check(_unpadded(block), expected, TOL, f"tp{tp} step")
        out[f"tp{tp}_shapes"] = {n: tuple(p.shape) for n, p in block.named_parameters()}
    block, _ = _block(4, seed=20, head_aligned=True)
    _scribble(block)
    load_checkpoint(root / "nxd", "t", model=block)
    _check(_unpadded(block), saved, EXACT, "NxD layout -> tp4 head-aligned")
    block, _ = _block(2, seed=21)
    load_checkpoint(root, "unmarked", model=block)
    _check(_unpadded(block), expected, EXACT, "padded tensors -> tp2")
    if dist.get_rank() == 0:
        from nxd_ckpt.hf import export_hf

        export_hf(root, root / "hf", tag="tp2", config={"model_type": "test"})
        from safetensors.torch import load_file

        exported = load_file(root / "hf" / "model.safetensors")
        _check(exported, saved, EXACT, "export")
        index = json.loads((root / "tp2" / "index.json").read_text())
        out["records"] = {
            name: {"shape": record["shape"], "padding": record["sharding"].get("padding")}
            for name, record in index["tensors"]["model"].items()
        }
        out["optimizer_shape"] = index["tensors"]["optimizer"]["up.weight/exp_avg"]["shape"]
        out["stored_elements"] = sum(
            sum(torch.Size(c["shape"]).numel() for c in record["chunks"])
            for record in index["tensors"]["model"].values()
        )
    return out


def test_padded_checkpoint_reloads_at_other_tp_degrees(tmp_path: Path) -> None:
    out = run_distributed(padded_round_trips, 4, str(tmp_path))[0]
    per_rank = {"dim": 0, "unpadded_size": WIDTH, "padded_size": 16, "layout": "per_rank"}
    assert out["records"] == {
        "up.weight": {"shape": [WIDTH, HIDDEN], "padding": {**per_rank, "tp_size": 2}},
        "up.bias": {"shape": [WIDTH], "padding": {**per_rank, "tp_size": 2}},
        "down.weight": {"shape": [HIDDEN, WIDTH], "padding": {**per_rank, "dim": 1, "tp_size": 2}},
        "down.bias": {"shape": [HIDDEN], "padding": None},
        "head.weight": {"shape": [WIDTH, HIDDEN], "padding": {**per_rank, "tp_size": 2}},
        "head.bias": {"shape": [WIDTH], "padding": {**per_rank, "tp_size": 2}},
    }
    assert out["optimizer_shape"] == [WIDTH, HIDDEN]
    assert out["stored_elements"] == 3 * WIDTH * HIDDEN + 2 * WIDTH + HIDDEN  # no zeros stored
    assert out["tp1_shapes"]["up.weight"] == (WIDTH, HIDDEN)  # TP=1: nothing to pad
    assert out["tp4_shapes"]["up.weight"] == (4, HIDDEN)  # TP=4: 4 heads, one per rank
