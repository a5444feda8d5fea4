"""Packed experts written per expert, as ``transformers`` writes Mixtral and Qwen-MoE folders.

transformers 5 holds a MoE layer's ``E`` experts packed, ``gate_up_proj`` ``(E, 2I, H)`` with
rows ``[G_e; U_e]`` and ``down_proj`` ``(E, H, I)``, but its ``save_pretrained`` writes them as
the Hub's checkpoints store them, one tensor per expert and projection:

    G_e = gate_up_proj[e, :I],   U_e = gate_up_proj[e, I:],   D_e = down_proj[e]

named ``<block>.experts.<e>.<gate|up|down>.weight`` with Mixtral's ``block_sparse_moe`` block
and ``w1`` / ``w3`` / ``w2`` (its router ``block_sparse_moe.gate.weight`` too), Qwen2-MoE's and
Qwen3-MoE's ``mlp`` block and ``gate_proj`` / ``up_proj`` / ``down_proj``. A folder in that
layout loads in every transformers release and in other tools reading Hub checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["PER_EXPERT", "per_expert_tensors", "write_experts_per_expert"]

PER_EXPERT: dict[str, tuple[str, tuple[str, str, str]]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
"""Per family: the MoE block's name in a saved folder and its gate / up / down projections."""

GATE_UP, DOWN, ROUTER = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj", ".mlp.gate.weight"


def per_expert_tensors(
    model_type: str, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The saved-folder tensors of the model's tensor ``name``: a packed expert tensor split
    per expert (module docstring), Mixtral's router renamed, any other tensor as it is."""
    block, (gate, up, down) = PER_EXPERT[model_type]
    if name.endswith(GATE_UP):
        prefix = name[: -len(GATE_UP)]
        if tensor.dim() != 3 or tensor.shape[1] % 2:
            raise ValueError(f"{name}: expected (E, 2I, H), got {tuple(tensor.shape)}")
        gates, ups = tensor.chunk(2, dim=1)
        out = []
        for e in range(tensor.shape[0]):
            out.append((f"{prefix}.{block}.experts.{e}.{gate}.weight", gates[e].clone()))
            out.append((f"{prefix}.{block}.experts.{e}.{up}.weight", ups[e].clone()))
        return out
    if name.endswith(DOWN):
        prefix = name[: -len(DOWN)]
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected (E, H, I), got {tuple(tensor.shape)}")
        return [
            (f"{prefix}.{block}.experts.{e}.{down}.weight", tensor[e].clone())
            for e in range(tensor.shape[0])
        ]
    if name.endswith(ROUTER) and block != "mlp":
        return [(f"{name[: -len(ROUTER)]}.{block}.gate.weight", tensor)]
    return [(name, tensor)]


def write_experts_per_expert(folder: str | Path, model_type: str) -> None:
    """Rewrite the ``model*.safetensors`` shards of an exported ``folder`` with the family's
    packed experts per expert (and ``model.safetensors.index.json``'s map), one shard at a
    time: host memory about one shard."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    renamed: dict[str, list[str]] = {}
    for path in sorted(folder.glob("model*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
                pieces = per_expert_tensors(model_type, name, f.get_tensor(name))
                renamed[name] = [piece for piece, _ in pieces]
                tensors.update(pieces)
        save_file(tensors, str(path), metadata=metadata)
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {
            new: shard
            for name, shard in index["weight_map"].items()
            for new in renamed.get(name, [name])
        }
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
