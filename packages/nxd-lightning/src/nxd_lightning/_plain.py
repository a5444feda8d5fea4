"""A plain ``LightningModule`` under the NxD strategy: what DDP gives, over nxd's DP group.

For a module that is not a :class:`~nxd_lightning.NeuronLTModule` (whose nxd optimizer reduces
gradients itself), the strategy

* refuses ``pipeline_parallel_size > 1`` (Lightning's loop cannot run a pipeline schedule),
  ``expert_parallel_size > 1`` (DP rank 0's start and the DP mean shard no expert, and would
  mix experts that EP ranks hold apart), and ``tensor_parallel_size > 1`` when the module holds
  no nxd tensor-parallel parameter (it would run replicated over TP, each rank doing all the
  work: not parallel, and not what the degree promises);
* makes the replicas start equal, as DDP does: every parameter and buffer is broadcast from
  DP rank 0 of its DP group;
* after the backward of the step's last micro-batch and before clipping and the optimizer,
  sets every gradient to its mean over DP, g <- (1/D) Σ_d g_d (DDP's average, so DP ranks on
  1/D of the global batch each train like one process on all of it); a gradient that is None
  on some ranks counts as zero there, and stays None where it is None on every rank;
  sequence-parallel parameters' gradients are first summed over TP (nxd's rule);
* clips by norm over the whole model: ||g|| over TP and PP, counting each replicated element
  once (``nxd_layers.clip_grad_norm``), the norm of the one-process model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import nxd_state
from nxd_state import collectives

__all__ = [
    "average_gradients_over_dp",
    "broadcast_from_dp_rank0",
    "check_plain_module",
    "clip_grad_norm_full",
    "tensor_parallel_parameters",
]


def tensor_parallel_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters that nxd's TP layers mark as sharded over TP."""
    return [
        name
        for name, param in module.named_parameters()
        if getattr(param, "tensor_model_parallel", False)
    ]


def check_plain_module(module: nn.Module, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Refuse the degrees a plain LightningModule cannot honour (module docstring)."""
    name = type(module).__qualname__
    state = nxd_state.get_parallel_state() if nxd_state.model_parallel_is_initialized() else None
    if state is not None and state.context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={state.context_parallel_size} with {name}, a plain "
            f"LightningModule: its batches are not split over the sequence and its gradients are "
            f"averaged over data parallelism only. Expected context_parallel_size=1"
        )
    if state is not None and state.expert_model_parallel_size > 1:
        raise ValueError(
            f"expert_parallel_size={state.expert_model_parallel_size} with {name}, a plain "
            f"LightningModule: the strategy starts its replicas from DP rank 0 and averages "
            f"every gradient over all of data parallelism, which shards no expert (and would mix "
            f"different experts' weights if it held nxd_layers.moe layers). Expected "
            f"expert_parallel_size=1, or a NeuronLTModule (initialize_parallel_model shards the "
            f"experts of Mixtral / Qwen-MoE and nxd_layers.moe models; its optimizer averages "
            f"expert gradients over the expert-DP group)"
        )
    if pipeline_parallel > 1:
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel} with {name}, a plain LightningModule: "
            f"Lightning's training loop cannot run a pipeline schedule. Expected "
            f"pipeline_parallel_size=1, or a NeuronLTModule (its model_fn is built by "
            f"initialize_parallel_model and trained by the pipeline schedule)"
        )
    if tensor_parallel > 1 and not tensor_parallel_parameters(module):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel} but {name} holds no nxd tensor-parallel "
            f"layer (no parameter marked tensor_model_parallel): every rank would run the whole "
            f"model, replicated, not parallelized. Expected tensor_parallel_size=1, a module "
            f"built from nxd_layers' parallel layers (ColumnParallelLinear, RowParallelLinear, "
            f"ParallelEmbedding), or a NeuronLTModule (initialize_parallel_model parallelizes "
            f"supported Hugging Face models)"
        )


def broadcast_from_dp_rank0(module: nn.Module) -> None:
    """Parameters and buffers <- those of DP rank 0 of this rank's DP group (DDP's start)."""
    state = nxd_state.get_parallel_state()
    if state.data_parallel_size == 1:
        return
    src = state.data_parallel_ranks[0]
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            collectives.broadcast(tensor.data, src, state.data_parallel_group)


def _trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for param in params:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def average_gradients_over_dp(params: Iterable[torch.Tensor]) -> None:
    """g <- (1/D) Σ_d g_d over the DP group for every trainable parameter (None counts as zero
    where another rank has a gradient); SP parameters' gradients are summed over TP first."""
    from nxd_layers import allreduce_sequence_parallel_gradients, bucket_allreduce_gradients

    state = nxd_state.get_parallel_state()
    params = _trainable(params)
    if state.tensor_parallel_size > 1:
        allreduce_sequence_parallel_gradients(params)
    if state.data_parallel_size == 1 or not params:
        return
    device = params[0].device
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    collectives.all_reduce(present, group=state.data_parallel_group)
    grads = []
    for param, count in zip(params, present.tolist()):
        if count == 0:
            continue  # no rank has a gradient: it stays None everywhere
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    bucket_allreduce_gradients(grads)


def clip_grad_norm_full(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """g <- g * min(1, max_norm / (||g|| + 1e-6)), ||g|| the 2-norm of the whole model's
    gradient (over TP and PP, replicated elements once): torch's ``clip_grad_norm_`` of the
    one-process model."""
    from nxd_layers import clip_grad_norm

    return clip_grad_norm(list(params), max_norm)
