"""Tiny parallel training runs for checkpoint tests and benchmarks.

``build(Degrees(tp=2, pp=2, dp=2, zero1=True))`` initialises the parallel state and returns a
``TinyGPT`` (nxd_pipeline.testing) with tensor-parallel blocks, cut into pipeline stages when
``pp > 1``, and an ``NxDOptimizer`` (AdamW, clipping, ZeRO-1 on or off). Every layout starts
from the same weights (drawn in one process from ``seed``, then sliced), and
:func:`train_step` feeds every layout the same global batch (each DP rank its slice), so any
two layouts follow the same trajectory up to float reassociation. :func:`full_state` gathers
this rank's parameters over TP (through nxd_layers, not through this package).

AdamW runs with ``eps=1e-5``: the attention key bias has an exactly zero gradient in exact
arithmetic (softmax is invariant to a per-query shift), so its computed gradient is rounding
noise of ~1e-9 that a tiny eps would normalise into full-size ±lr steps, different for every
reduction order. With eps = 1e-5 such noise moves a parameter by < 1e-6, while real
gradients (1e-3 and up) are normalised as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Degrees", "build", "full_state", "tensor_parallel_llama", "train_step"]

GLOBAL_BATCH = 8
SEQUENCE = 8
VOCAB = 64


@dataclass(frozen=True)
class Degrees:
    """A parallel layout: TP x PP x DP ranks, ZeRO-1 on or off."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (layers split evenly into this many stages)."""
    dp: int = 1
    """Data-parallel size."""
    zero1: bool = False
    """Shard optimizer state over DP (NeuronZero1Optimizer)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp{self.tp}-pp{self.pp}-dp{self.dp}-{'zero1' if self.zero1 else 'plain'}"


def build(
    degrees: Degrees,
    *,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    lr: float = 1e-2,
    eps: float = 1e-5,
    microbatches: int = 2,
) -> tuple[Any, Any]:
    """(model, optimizer) at ``degrees`` (re-initialises the nxd parallel state)."""
    import nxd_state
    from nxd_optim import build_optimizer
    from nxd_pipeline import NxDPPModel
    from nxd_pipeline.testing import Block, TinyGPT, copy_into_tensor_parallel

    if nxd_state.model_parallel_is_initialized():
        nxd_state.destroy_model_parallel()
    state = nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=degrees.tp, pipeline_model_parallel_size=degrees.pp
    )
    if state.data_parallel_size != degrees.dp:
        raise ValueError(f"{degrees} needs {degrees.world_size} ranks, the world has another size")
    torch.manual_seed(seed)
    plain = TinyGPT(vocab=VOCAB, hidden=hidden, layers=layers, heads=heads)
    model: Any = TinyGPT(
        vocab=VOCAB, hidden=hidden, layers=layers, heads=heads, tensor_parallel=True
    )
    copy_into_tensor_parallel(model, plain, state.tensor_parallel_rank, degrees.tp)
    params: Any = model.parameters()
    if degrees.pp > 1:
        per = layers // degrees.pp
        model = NxDPPModel(
            model,
            transformer_layer_cls=Block,
            num_microbatches=microbatches,
            pipeline_cuts=[f"h.{per * (k + 1) - 1}" for k in range(degrees.pp - 1)],
            use_zero1_optimizer=True,  # the optimizer averages gradients over DP
        )
        params = model.local_parameters()
    optimizer = build_optimizer(
        {"zero_one_enabled": degrees.zero1, "grad_clipping": True, "max_grad_norm": 1.0},
        torch.optim.AdamW,
        list(params),
        lr=lr,
        eps=eps,
        weight_decay=0.01,
    )
    return model, optimizer


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step`` (same on every rank)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQUENCE), generator=generator)


def train_step(model: Any, optimizer: Any, step: int) -> None:
    """One optimizer step on this DP rank's slice of :func:`batch`."""
    import nxd_state
    from nxd_pipeline import NxDPPModel

    state = nxd_state.get_parallel_state()
    per = GLOBAL_BATCH // state.data_parallel_size
    ids = batch(step)[state.data_parallel_rank * per : (state.data_parallel_rank + 1) * per]
    if isinstance(model, NxDPPModel):
        model.run_train(input_ids=ids, labels=ids)
    else:
        model(ids, ids).backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters, gathered over TP, by name (collective over TP)."""
    from nxd_layers import full_tensor
    from nxd_pipeline import NxDPPModel

    named = (
        model.local_named_parameters()
        if isinstance(model, NxDPPModel)
        else model.named_parameters()
    )
    return {name: full_tensor(param).clone() for name, param in named}


_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def tensor_parallel_llama(path: str) -> Any:
    """A Hugging Face Llama from ``path`` with its projections swapped for nxd's column/row
    parallel layers holding this TP rank's slices (HF's attention reshapes with -1 heads,
    so local heads just work). Needs transformers."""
    from transformers import LlamaForCausalLM

    import nxd_state
    from nxd_layers import ColumnParallelLinear, RowParallelLinear, shard_for_rank

    state = nxd_state.get_parallel_state()
    rank, tp = state.tensor_parallel_rank, state.tensor_parallel_size
    model = LlamaForCausalLM.from_pretrained(path)
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in _COLUMN + _ROW:
            continue
        layer: ColumnParallelLinear | RowParallelLinear
        if leaf in _COLUMN:
            layer = ColumnParallelLinear(
                module.in_features, module.out_features, bias=False, gather_output=False
            )
            weight = shard_for_rank(module.weight.detach(), 0, rank, tp)
        else:
            layer = RowParallelLinear(
                module.in_features, module.out_features, bias=False, input_is_parallel=True
            )
            weight = shard_for_rank(module.weight.detach(), 1, rank, tp)
        with torch.no_grad():
            layer.weight.copy_(weight)
        model.set_submodule(name, layer)
    return model
