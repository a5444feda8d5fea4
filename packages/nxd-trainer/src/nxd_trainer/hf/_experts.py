"""Expert parallelism for transformers' packed MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE).

transformers 5 holds the ``E`` experts of a MoE layer as two packed parameters,
``gate_up_proj`` ``(E, 2I, H)`` (rows ``[G_e; U_e]``) and ``down_proj`` ``(E, H, I)``; given
the router's ``top_k_index`` and ``top_k_weights`` ``w`` (T, k) its experts module returns

    out_t = sum_j w_tj D_e (act(G_e x_t) * (U_e x_t)),   e = top_k_index[t, j]

for every assignment (dropless). The router (softmax, top-k, ``norm_topk_prob``), the shared
expert and its sigmoid gate stay the family's own modules, replicated; only the experts module
is replaced, by :class:`ExpertParallelExperts`:

* **EP**: EP rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)``. nxd-layers'
  :func:`~nxd_layers.moe.plan_dispatch` (dropless) sorts this rank's assignments by expert;
  their token rows go to the ranks holding their experts (all-to-all), each local expert runs
  on its rows (``F.linear``, as transformers), the results come back (the same all-to-all,
  counts swapped) and are weighted by ``w`` and summed per token in expert order, as
  transformers does. The gradient of an expert is the sum over every EP rank's tokens.
* **TP inside each expert**: TP rank ``t`` holds features ``[t I/tp, (t+1) I/tp)`` of ``G_e``,
  ``U_e`` (rows of ``gate_up_proj``, stride 2: its gate rows then its up rows) and ``D_e``
  (columns of ``down_proj``); each TP rank computes a partial sum of every expert's output,
  summed by one all-reduce after the combine. The tokens and weights enter through
  ``copy_to_tensor_model_parallel_region`` (their gradients summed over TP).

nxd-layers' own ``ExpertMLPs`` is not used: it holds ``(E, H, 2I)`` weights and takes the
weights from the whole ``(T, E)`` affinities, where transformers' router hands over the chosen
weights already normalised and cast its own way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import nxd_state
from nxd_layers import set_tensor_model_parallel_attributes
from nxd_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from nxd_layers.moe import all_to_all_rows, plan_dispatch
from nxd_state import collectives
from nxd_trainer.hf._capture import capturing, stand_in
from nxd_trainer.hf._rules import UnsupportedModelError, forward_signature
from nxd_trainer.hf._sources import Source

__all__ = ["MOE_FAMILIES", "ExpertParallelExperts", "check_experts", "expert_paths", "swap_experts"]

KNOWN_EXPERTS = (
    ("mixtral", "MixtralExperts"),
    ("qwen2_moe", "Qwen2MoeExperts"),
    ("qwen3_moe", "Qwen3MoeExperts"),
)
"""transformers' experts modules whose forward is the module docstring's formula."""

MOE_FAMILIES = tuple(family for family, _ in KNOWN_EXPERTS)
"""Their families: parallelised by their tensor-parallel plan, experts sharded at EP > 1."""

EXPERT_ATTRIBUTES = {"expert_model_parallel": True, "expert_partition_dim": 0}
"""nxd-optim's marks of an expert weight (dim 0 split over the EP group)."""


class ExpertParallelExperts(nn.Module):
    """A transformers packed-experts module sharded over EP (experts) and TP (features); its
    parameters keep transformers' names and layout (``gate_up_proj`` ``(E/ep, 2I/tp, H)``,
    ``down_proj`` ``(E/ep, H, I/tp)``), built on ``meta``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        ep_group: ProcessGroup,
        tp_group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.ep_group, self.tp_group = ep_group, tp_group
        self.ep = collectives.group_size(ep_group)
        self.tp = 1 if tp_group is None else collectives.group_size(tp_group)
        self.num_experts, self.hidden_dim = num_experts, hidden_size
        self.num_local_experts = num_experts // self.ep
        width = intermediate_size // self.tp
        local = self.num_local_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(local, 2 * width, hidden_size, dtype=dtype, device="meta")
        )
        self.down_proj = nn.Parameter(
            torch.empty(local, hidden_size, width, dtype=dtype, device="meta")
        )
        self.act_fn = act_fn
        for param, dim, stride in ((self.gate_up_proj, 1, 2), (self.down_proj, 2, 1)):
            for name, value in EXPERT_ATTRIBUTES.items():
                setattr(param, name, value)
            param.expert_model_parallel_size = self.ep  # type: ignore[attr-defined]
            tp_sharded = self.tp > 1
            set_tensor_model_parallel_attributes(
                param, tp_sharded, dim if tp_sharded else -1, stride if tp_sharded else 1
            )

    def _local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """``rows`` (R, H), row ``i`` for local expert ``expert[i]``, through their experts.
        Every local expert runs, on zero rows if none came: each gets a gradient."""
        out = rows.new_zeros(rows.shape)
        for e in range(self.num_local_experts):
            index = (expert == e).nonzero().squeeze(1)
            gate, up = F.linear(rows[index], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])  # (R_e, H)
            out = out.index_copy(0, index, y)
        return out

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``out`` (T, H) for tokens ``hidden_states`` (T, H) routed to ``top_k_index`` (T, k)
        with ``top_k_weights`` (T, k) (see the module docstring)."""
        if capturing():  # a pipeline's capture: this layer runs as a call (hf._capture)
            return stand_in(hidden_states)
        x, weights = hidden_states, top_k_weights
        if self.tp > 1:  # each TP rank computes a partial sum: input gradients add up
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
            weights = copy_to_tensor_model_parallel_region(weights, self.tp_group)
        top_k = top_k_index.shape[1]
        plan = plan_dispatch(top_k_index, self.num_experts, None, self.ep_group)
        token = plan.order // top_k  # (N,) token of each assignment, sorted by expert
        sent = all_to_all_rows(x[token], self.ep_group, plan.send_counts, plan.recv_counts)
        done = self._local_experts(sent, plan.recv_expert)  # (R, H)
        back = all_to_all_rows(done, self.ep_group, plan.recv_counts, plan.send_counts)  # (N, H)
        weighted = back * weights.reshape(-1)[plan.order].unsqueeze(1)  # (N, H)
        out = torch.zeros_like(x).index_add(0, token, weighted.to(x.dtype))
        if self.tp > 1:
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        return out


def _known_forwards() -> set[str]:
    """Normalised forwards of the packed experts whose computation is the module docstring's
    (transformers' own implementations: Mixtral's, Qwen2-MoE's, Qwen3-MoE's)."""
    known = set()
    for family, name in KNOWN_EXPERTS:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        known.add(forward_signature(getattr(module, name)))
    return known


def expert_paths(model: nn.Module) -> list[str]:
    """Paths of the modules holding packed experts (a 3-D ``gate_up_proj`` parameter)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
        and module.gate_up_proj.dim() == 3
    ]


def check_experts(model: nn.Module, family: str, ep: int, tp: int) -> list[str]:
    """The expert modules to shard over ``ep`` EP ranks (and ``tp`` inside each expert);
    refuses (naming the values) what :class:`ExpertParallelExperts` would not reproduce."""
    paths = expert_paths(model)
    if not paths:
        raise UnsupportedModelError(
            family,
            f"expert_model_parallel_size={ep} but the model has no mixture-of-experts layers "
            f"(packed experts) to shard over it",
        )
    known = _known_forwards()
    for path in paths:
        module: Any = model.get_submodule(path)  # a transformers experts module
        if forward_signature(type(module)) not in known:
            raise UnsupportedModelError(
                family,
                f"{path} ({type(module).__name__}) computes its experts otherwise than "
                f"Mixtral's / Qwen-MoE's packed experts, the only ones sharded over EP",
            )
        flags = {
            "has_bias": False,
            "has_gate": True,
            "is_transposed": False,
            "is_concatenated": True,
            "has_post_expert_norm": False,
        }
        for flag, wanted in flags.items():
            if getattr(module, flag, wanted) != wanted:
                raise UnsupportedModelError(
                    family, f"{path}.{flag}={getattr(module, flag)!r}, expected {wanted!r}"
                )
        experts, intermediate = module.gate_up_proj.shape[0], module.gate_up_proj.shape[1] // 2
        if experts % ep:
            raise ValueError(
                f"{family}: num_experts={experts} is not divisible by "
                f"expert_model_parallel_size={ep} (each EP rank holds num_experts / EP experts)"
            )
        if intermediate % tp:
            raise ValueError(
                f"{family}: the experts' intermediate size {intermediate} is not divisible by "
                f"tensor_parallel_size={tp} (TP splits each expert's features)"
            )
    return paths


def swap_experts(model: nn.Module, family: str, sources: dict[str, Any]) -> list[str]:
    """Replace every packed experts module by :class:`ExpertParallelExperts` on ``meta``
    (this EP rank's experts, this TP rank's features) and record in ``sources`` where their
    values come from; returns the paths swapped."""
    state = nxd_state.get_parallel_state()
    ep, tp = state.expert_model_parallel_size, state.tensor_parallel_size
    paths = check_experts(model, family, ep, tp)
    ep_rank, tp_rank = state.expert_model_parallel_rank, state.tensor_parallel_rank
    for path in paths:
        old: Any = model.get_submodule(path)  # a transformers experts module
        experts, two_i, hidden = old.gate_up_proj.shape
        intermediate = two_i // 2
        layer = ExpertParallelExperts(
            experts,
            hidden,
            intermediate,
            old.act_fn,
            old.gate_up_proj.dtype,
            state.expert_model_parallel_group,
            state.tensor_parallel_group if tp > 1 else None,
        )
        mine = (ep_rank * layer.num_local_experts, (ep_rank + 1) * layer.num_local_experts)
        width = intermediate // tp
        gate = (tp_rank * width, (tp_rank + 1) * width)
        up = (intermediate + gate[0], intermediate + gate[1])
        name = f"{path}.gate_up_proj"
        sources[name] = Source(name, "blocks", dim=1, blocks=((mine, gate), (mine, up)))
        name = f"{path}.down_proj"
        sources[name] = Source(name, "blocks", dim=2, blocks=((mine, (0, hidden), gate),))
        model.set_submodule(path, layer)
    return paths
