"""How a tensor of one of NxD's per-rank files maps into the global tensor.

NxD records no sharding: the spec of saved TP rank t of T comes from the *target* model's
attributes, with two differences from nxd's own layout worked out here.

* **Padding** (``nxd_layers.pad_model`` marks): NxD pads per rank at the saved degree T, so a
  padded target says where the zeros of NxD's file are: ``per_rank`` padding of the target's
  unpadded size to the saved size.
* **GQA with kv_size_multiplier m > 1**: NxD replicates K/V block-wise and its checkpoint
  converter regroups the Q heads and the output projection's input columns per rank, so
  that NxD's rank t holds what nxd_layers' layout (K/V head by head, Q heads in order) holds
  on rank ``s = nxd_layers.neuronx_gqa_rank_map(heads, kv_heads, T, m)[t]``: Q, K and V
  (weights and biases) and o_proj's weight are read as rank s's blocks at degree T with
  multiplier m. NxD defines this for one KV head per rank (kv_heads · m = T), so a saved
  rank's K rows are one head: head_dim = kv_size · m / T, m read off the file's K rows.
  The output projection is the target's RowParallelLinear next to the QKV projection (same
  parent module) taking ``q_size`` inputs, as in NxD's models (``self_attn.o_proj``).
  Everything else (MLP, embeddings, norms) is laid out alike.

m = 1 is the identity. The GQA blocks use the *saved* multiplier, whatever the target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nxd_ckpt.layout._sharding import ShardSpec, gqa_spec, is_gqa, spec_for_tensor

__all__ = ["SavedGQA", "saved_gqa_layouts", "saved_spec"]


@dataclass(frozen=True)
class SavedGQA:
    """One GQA projection as NxD saved it at ``tp`` ranks."""

    q_size: int
    kv_size: int
    multiplier: int
    head_dim: int
    rank_map: list[int]
    """Entry t: the rank of nxd's layout holding what NxD's rank t holds."""

    def replica_rows(self) -> list[int]:
        from nxd_layers import gqa_kv_replica_rows

        if self.multiplier == 1:
            return list(range(self.kv_size))
        return gqa_kv_replica_rows(self.kv_size // self.head_dim, self.head_dim, self.multiplier)


def _saved_kv_rows(prefix: str, q_size: int, size: int, tensors: Mapping[str, Any]) -> int | None:
    """Rows of one saved rank's K projection of module ``prefix`` (None: not in the files)."""
    k = tensors.get(f"{prefix}.weight_k")
    if k is not None:
        return int(k.shape[0])
    fused = tensors.get(f"{prefix}.weight_qkv")
    if fused is not None:
        return (int(fused.shape[0]) - q_size // size) // 2
    return None


def _output_projection(modules: Mapping[str, nn.Module], prefix: str, q_size: int) -> str:
    """The RowParallelLinear beside GQA projection ``prefix`` that takes its ``q_size``
    attention features (NxD regroups its input columns with the heads)."""
    parent = prefix.rpartition(".")[0]
    found = [
        name
        for name, module in modules.items()
        if name != prefix
        and name.rpartition(".")[0] == parent
        and getattr(module, "input_size", None) == q_size
        and getattr(getattr(module, "weight", None), "partition_dim", None) == 1
        and getattr(module.weight, "tensor_model_parallel", False)
    ]
    if len(found) != 1:
        raise NotImplementedError(
            f"{prefix}: NxD's GQA checkpoints (kv_size_multiplier > 1) regroup the output "
            f"projection's input columns with the heads; nxd-ckpt looks for exactly one "
            f"RowParallelLinear with input_size {q_size} beside it (in "
            f"{parent or 'the model'}) and found {found or 'none'}"
        )
    return found[0]


def saved_gqa_layouts(
    modules: Mapping[str, nn.Module], tensors: Mapping[str, Any], size: int
) -> dict[str, SavedGQA]:
    """Module name -> how NxD laid out that GQA projection (and, for m > 1, its output
    projection) at ``size`` ranks, from ``tensors``: one saved rank's files (any PP rank)."""
    from nxd_layers import neuronx_gqa_rank_map

    layouts: dict[str, SavedGQA] = {}
    for prefix, module in modules.items():
        if not is_gqa(module):
            continue
        q_size, kv_size = (int(s) for s in module.output_sizes)
        rows = _saved_kv_rows(prefix, q_size, size, tensors)
        if rows is None:
            continue
        if rows <= 0 or (rows * size) % kv_size:
            raise ValueError(
                f"{prefix}: a saved rank holds {rows} K rows, which at TP={size} is no whole "
                f"replication of kv_size {kv_size}"
            )
        multiplier = rows * size // kv_size
        if multiplier == 1:
            layouts[prefix] = SavedGQA(q_size, kv_size, 1, kv_size, list(range(size)))
            continue
        head_dim = rows  # one KV head per rank (checked by the rank map)
        rank_map = neuronx_gqa_rank_map(q_size // head_dim, kv_size // head_dim, size, multiplier)
        layout = SavedGQA(q_size, kv_size, multiplier, head_dim, rank_map)
        layouts[prefix] = layout
        layouts[_output_projection(modules, prefix, q_size)] = layout
    return layouts


def saved_spec(
    target: torch.Tensor,
    module: Any,
    prefix: str,
    leaf: str,
    shape: tuple[int, ...],
    t: int,
    size: int,
    layouts: Mapping[str, SavedGQA],
) -> ShardSpec:
    """How saved rank t of ``size``'s tensor ``prefix.leaf`` of ``shape`` maps into the
    global tensor, under the attributes of the ``target`` parameter (see the module
    docstring)."""
    probe = torch.empty(shape, device="meta")
    for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(target, attribute):
            setattr(probe, attribute, getattr(target, attribute))
    padding = getattr(target, "tensor_parallel_padding", None)
    if padding is not None:  # NxD's pad_model pads per rank, at the saved TP degree
        sharded = getattr(target, "tensor_model_parallel", False)
        saved_size = shape[padding.dim] * (size if sharded else 1)
        if saved_size != padding.unpadded_size:
            # An ad-hoc attribute, as nxd_layers.pad_model marks it: torch's Tensor stubs
            # declare no such attribute.
            probe.tensor_parallel_padding = type(padding)(  # type: ignore[attr-defined]
                padding.dim, padding.unpadded_size, saved_size, "per_rank", size
            )
    layout = layouts.get(prefix)
    if layout is not None and is_gqa(module) and leaf.startswith(("weight_", "bias_")):
        rows = layout.replica_rows()
        rank = layout.rank_map[t]
        return gqa_spec(
            layout.q_size, layout.kv_size, layout.multiplier, rows, leaf, shape, rank, size
        )
    rank = layout.rank_map[t] if layout is not None and leaf == "weight" else t
    return spec_for_tensor(probe, tp_rank=rank, tp_size=size, module=module, local_name=leaf)
