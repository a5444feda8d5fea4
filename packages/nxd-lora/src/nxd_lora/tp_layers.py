"""LoRA on tensor-parallel layers, split so that no full-size activation is gathered.

Column-parallel base (``W`` split by output rows over ``p`` ranks)::

    Y_i = X W_i^T + s · (dropout(X) A^T) B_i^T      A replicated (r, in), B_i (out/p, r)

the adapter's only communication is B's own: the ``(.., r)`` input gradient all-reduced in
backward (or, under sequence parallelism, the ``(.., r)`` activation all-gathered).

Row-parallel base (``W`` split by input columns)::

    Y = sum_i X_i W_i^T + s · (sum_i dropout(X)_i A_i^T) B^T     A_i (r, in/p), B replicated

A is row-parallel, so the reduction is of the ``(.., r)`` low-rank activation, never of a
``(.., out)`` one. Both start from full-size master weights sliced per rank, so any TP degree
builds the same adapter as one process given the same seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import torch
from torch import nn
from torch.distributed import ProcessGroup

from nxd_layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    RowParallelLinear,
    gather_tensor_parallel_shards,
    mark_sequence_parallel_parameter,
    shard_for_rank,
)
from nxd_lora.config import LoraConfig
from nxd_lora.layers import LoraLayer, copy_full_into, lora_a_master
from nxd_state import collectives, get_rng_tracker

__all__ = ["LoraGQAQKVParallelLinear", "LoraParallelLinear", "tp_layer_factories"]


def _zeros(weight: torch.Tensor) -> None:
    weight.zero_()


def _copy_of(full: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    return lambda weight: weight.copy_(full)


@contextlib.contextmanager
def sharded_input_rng(sharded: bool, dropout: nn.Module) -> Iterator[None]:
    """Dropout on a TP-sharded input draws from the TP-distinct stream; replicated input from
    the shared one (so every TP rank drops the same elements of a replicated tensor)."""
    if sharded and isinstance(dropout, nn.Dropout):
        with get_rng_tracker().fork():
            yield
    else:
        yield


class _SharedOptions(TypedDict):
    """What the adapter's parallel linear takes over from the base layer."""

    bias: bool
    sequence_parallel_enabled: bool
    sequence_dimension: int
    dtype: torch.dtype
    device: torch.device
    tensor_parallel_group: ProcessGroup


class LoraParallelLinear(LoraLayer[ColumnParallelLinear | RowParallelLinear]):
    """LoRA on a ``ColumnParallelLinear`` (B column-parallel) or ``RowParallelLinear`` (A
    row-parallel); see the module docstring for the math."""

    def __init__(
        self, base_layer: ColumnParallelLinear | RowParallelLinear, config: LoraConfig
    ) -> None:
        super().__init__(base_layer, config)
        self.is_row_parallel = isinstance(base_layer, RowParallelLinear)
        self.tensor_parallel_group = base_layer.tensor_parallel_group
        self.in_features, self.out_features = base_layer.input_size, base_layer.output_size
        weight = base_layer.weight
        rank = self.lora_rank
        sequence_parallel = base_layer.sequence_parallel_enabled
        shared: _SharedOptions = {
            "bias": False,
            "sequence_parallel_enabled": sequence_parallel,
            "sequence_dimension": base_layer.sequence_dimension,
            "dtype": weight.dtype,
            "device": weight.device,
            "tensor_parallel_group": self.tensor_parallel_group,
        }
        full_a = lora_a_master(
            (rank, self.in_features),
            config.init_lora_weights,
            rank,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        self.lora_A: RowParallelLinear | nn.Linear
        self.lora_B: nn.Linear | ColumnParallelLinear
        if isinstance(base_layer, RowParallelLinear):
            self.lora_A = RowParallelLinear(
                self.in_features,
                rank,
                input_is_parallel=base_layer.input_is_parallel,
                stride=base_layer.stride,
                init_method=_copy_of(full_a),
                **shared,
            )
            self.lora_B = nn.Linear(
                rank, self.out_features, bias=False, dtype=weight.dtype, device=weight.device
            )
            nn.init.zeros_(self.lora_B.weight)
            if sequence_parallel:  # B sees one sequence shard: its gradient is partial
                mark_sequence_parallel_parameter(self.lora_B.weight)
            self.input_is_sharded = base_layer.input_is_parallel
        else:
            self.lora_A = nn.Linear(
                self.in_features, rank, bias=False, dtype=weight.dtype, device=weight.device
            )
            with torch.no_grad():
                self.lora_A.weight.copy_(full_a)
            self.lora_B = ColumnParallelLinear(
                rank,
                self.out_features,
                gather_output=base_layer.gather_output,
                stride=base_layer.stride,
                init_method=_zeros,
                **shared,
            )
            if sequence_parallel:  # A sees one sequence shard: its gradient is partial
                mark_sequence_parallel_parameter(self.lora_A.weight)
            self.input_is_sharded = sequence_parallel

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.lora_B.weight.dtype)
        with sharded_input_rng(self.input_is_sharded, self.lora_dropout):
            dropped = self.lora_dropout(x)
        return self.lora_B(self.lora_A(dropped)) * self.scaling

    def delta_weights(self) -> dict[str, torch.Tensor]:
        # column: B_i (out/p, r) @ A (r, in); row: B (out, r) @ A_i (r, in/p): the base's shard
        return {"weight": (self.lora_B.weight @ self.lora_A.weight) * self.scaling}


class LoraGQAQKVParallelLinear(LoraLayer[GQAQKVColumnParallelLinear]):
    """LoRA on ``GQAQKVColumnParallelLinear``: one replicated A, a column-parallel QKV B.

        (Q, K, V)_i = base(X)_i + s · (dropout(X) A^T) (B_q, B_k, B_v)_i^T

    B is itself a ``GQAQKVColumnParallelLinear(r, [q, kv])`` laid out like the base (KV heads
    replicated ``kv_size_multiplier`` times, fused or not), so ``ΔW_q = s · B_q A`` is exactly
    the base's shard. As a PEFT adapter it becomes three modules (``peft_qkv_names``, default
    ``q_proj``/``k_proj``/``v_proj`` next to this one) sharing the same ``lora_A``.
    """

    def __init__(self, base_layer: GQAQKVColumnParallelLinear, config: LoraConfig) -> None:
        super().__init__(base_layer, config)
        self.tensor_parallel_group = base_layer.tensor_parallel_group
        self.in_features, self.out_features = base_layer.input_size, list(base_layer.output_sizes)
        self.peft_qkv_names = ("q_proj", "k_proj", "v_proj")
        params = [p for n, p in base_layer.named_parameters() if n.startswith("weight")]
        dtype, device = params[0].dtype, params[0].device
        rank = self.lora_rank
        full_a = lora_a_master(
            (rank, self.in_features),
            config.init_lora_weights,
            rank,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, dtype=dtype, device=device)
        with torch.no_grad():
            self.lora_A.weight.copy_(full_a)
        multiplier = base_layer.kv_size_multiplier
        self.lora_B = GQAQKVColumnParallelLinear(
            rank,
            list(base_layer.output_sizes),
            bias=False,
            gather_output=base_layer.gather_output,
            sequence_parallel_enabled=base_layer.sequence_parallel_enabled,
            dtype=dtype,
            device=device,
            init_method=_zeros,
            kv_size_multiplier=multiplier,
            fuse_qkv=base_layer.fuse_qkv,
            tensor_parallel_group=self.tensor_parallel_group,
            head_dim=base_layer.head_dim if multiplier > 1 else None,
            sequence_dimension=base_layer.sequence_dimension,
        )
        if base_layer.sequence_parallel_enabled:
            mark_sequence_parallel_parameter(self.lora_A.weight)

    def adapter_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with sharded_input_rng(self.base_layer.sequence_parallel_enabled, self.lora_dropout):
            dropped = self.lora_dropout(x.to(self.lora_A.weight.dtype))
        return tuple(y * self.scaling for y in self.lora_B(self.lora_A(dropped)))

    def delta_weights(self) -> dict[str, torch.Tensor]:
        a = self.lora_A.weight
        names = (
            ("weight_qkv",) if self.base_layer.fuse_qkv else ("weight_q", "weight_k", "weight_v")
        )
        return {name: (getattr(self.lora_B, name) @ a) * self.scaling for name in names}

    # PEFT: three modules sharing A ------------------------------------------------------------
    def _peft_module_names(self, name: str) -> list[str]:
        parent = name.rpartition(".")[0]
        return [f"{parent}.{part}" if parent else part for part in self.peft_qkv_names]

    def peft_tensor_names(self, name: str) -> list[str]:
        return [
            f"{module}.{tensor}"
            for module in self._peft_module_names(name)
            for tensor in ("lora_A.weight", "lora_B.weight")
        ]

    def _local_b_parts(self) -> tuple[torch.Tensor, ...]:
        """This rank's (B_q, B_k, B_v) rows, split out of ``weight_qkv`` when fused."""
        b = self.lora_B
        if b.fuse_qkv:
            sizes = [b.q_output_size_per_partition, *[b.kv_output_size_per_partition] * 2]
            return tuple(b.get_parameter("weight_qkv").detach().split(sizes, dim=0))
        return tuple(b.get_parameter(f"weight_{part}").detach() for part in "qkv")

    def _replicate_heads(self, full: torch.Tensor) -> torch.Tensor:
        """(kv_heads·head_dim, r) -> each head's rows repeated ``kv_size_multiplier`` times."""
        b = self.lora_B
        heads = full.reshape(b.kv_heads, b.head_dim, -1)
        return heads.repeat_interleave(b.kv_size_multiplier, dim=0).reshape(-1, full.shape[-1])

    def peft_tensors(self, name: str) -> dict[str, torch.Tensor]:
        group, b = self.tensor_parallel_group, self.lora_B
        out = {}
        for module, part, local in zip(self._peft_module_names(name), "qkv", self._local_b_parts()):
            full = gather_tensor_parallel_shards(local, 0, 1, group)
            if part != "q" and b.kv_size_multiplier > 1:  # keep the first replica of each head
                heads = full.reshape(b.kv_heads, b.kv_size_multiplier, b.head_dim, -1)
                full = heads[:, 0].reshape(b.kv_heads * b.head_dim, -1)
            out[f"{module}.lora_A.weight"] = self.lora_A.weight.detach().clone()
            out[f"{module}.lora_B.weight"] = full.clone()
        return out

    def load_peft_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> list[str]:
        b = self.lora_B
        rank, size = collectives.group_rank(b.tensor_parallel_group), b.tensor_parallel_size
        keys = self.peft_tensor_names(name)
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ValueError(f"the adapter has no tensors {missing} for LoRA layer {name!r}")
        a_keys = keys[0::2]
        if any(not torch.equal(tensors[a_keys[0]], tensors[k]) for k in a_keys[1:]):
            raise ValueError(
                f"{a_keys} differ: a fused QKV LoRA layer shares one A between q, k and v"
            )
        copy_full_into(self.lora_A.weight, tensors[a_keys[0]], a_keys[0])
        shards = []
        for part, key in zip("qkv", keys[1::2]):
            full = tensors[key]
            expected = (self.out_features[0 if part == "q" else 1], self.lora_rank)
            if tuple(full.shape) != expected:
                raise ValueError(
                    f"{key}: adapter tensor has shape {tuple(full.shape)}, "
                    f"the model expects {expected}"
                )
            if part != "q" and b.kv_size_multiplier > 1:
                full = self._replicate_heads(full)
            shards.append(shard_for_rank(full, 0, rank, size))
        with torch.no_grad():
            if b.fuse_qkv:
                b.get_parameter("weight_qkv").copy_(torch.cat(shards))
            else:
                for part, shard in zip("qkv", shards):
                    b.get_parameter(f"weight_{part}").copy_(shard)
        return keys


def tp_layer_factories() -> list[tuple[type, Callable[[Any, LoraConfig], LoraLayer]]]:
    """``(tensor-parallel base type, LoRA layer class)`` pairs for :class:`LoRAModel`."""
    return [
        (GQAQKVColumnParallelLinear, LoraGQAQKVParallelLinear),
        (ColumnParallelLinear, LoraParallelLinear),
        (RowParallelLinear, LoraParallelLinear),
    ]
