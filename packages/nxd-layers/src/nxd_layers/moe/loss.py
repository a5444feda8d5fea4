"""Auxiliary router losses, optionally over the tokens of a whole group of ranks.

Load balancing (Switch Transformer eq. 4-6, with top-k as Mixtral and NxD):
``L_aux = E * sum_e f_e P_e`` with ``f_e`` the fraction of the ``T k`` assignments that go to
expert ``e`` (top-k of ``softmax(z)``, ties to the lower index) and ``P_e`` the mean over
tokens of ``softmax(z)_e`` (NxD's ``E / k * sum_e (count_e / T) P_e``, the same number).
Router z-loss (ST-MoE): ``L_z = mean_t (logsumexp_e z_te)^2``.

With ``group`` (e.g. the EP group), the means run over the tokens of every rank of the group
(token counts and sums all-reduced; the ``P_e`` sum carries the gradient both ways), so each
rank gets the loss of the concatenated batch: the one-process value. Without it, the loss
of this rank's tokens (NxD's behaviour).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from nxd_layers.moe._comm import all_reduce_sum, group_size
from nxd_layers.moe._topk import stable_top_k
from nxd_state import collectives

__all__ = ["load_balancing_loss_func", "router_z_loss_func"]


def _global_count(n: int, like: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    count = torch.tensor([float(n)], dtype=torch.float64, device=like.device)
    if group_size(group) > 1:
        collectives.all_reduce(count, group)
    return count


def load_balancing_loss_func(
    router_logits: torch.Tensor,
    num_experts: int,
    top_k: int,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``E * sum_e f_e P_e`` over the tokens of ``router_logits`` (..., E) (NxD's arguments;
    ``group``: average over every rank of it, see the module docstring)."""
    logits = router_logits.reshape(-1, router_logits.shape[-1])  # (T, E)
    if logits.shape[-1] != num_experts:
        raise ValueError(f"router_logits has {logits.shape[-1]} experts, num_experts={num_experts}")
    probs = F.softmax(logits, dim=-1, dtype=torch.float64)  # (T, E)
    chosen = stable_top_k(probs, top_k)  # (T, k)
    assigned = F.one_hot(chosen, num_experts).to(torch.float64).sum((0, 1))  # (E,)
    if group_size(group) > 1:
        collectives.all_reduce(assigned, group)
    tokens = _global_count(logits.shape[0], logits, group)
    prob_sum = all_reduce_sum(probs.sum(0), group)  # (E,)
    f = assigned / (tokens * top_k)
    p = prob_sum / tokens
    loss = (f * p).sum() * num_experts
    return loss.to(router_logits.dtype)


def router_z_loss_func(
    router_logits: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """``mean_t (logsumexp_e z_te)^2`` over the tokens of ``router_logits`` (..., E)."""
    logits = router_logits.reshape(-1, router_logits.shape[-1])
    z = torch.logsumexp(logits.to(torch.float64), dim=-1).square().sum()
    total = all_reduce_sum(z.reshape(1), group)
    return (total / _global_count(logits.shape[0], logits, group))[0].to(router_logits.dtype)
