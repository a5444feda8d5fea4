"""Routers: which experts each token goes to, and with what affinity.

Logits ``z = x W_r`` (``W_r``: hidden x E, replicated on every rank). Affinities are
``softmax(z)`` or ``sigmoid(z)`` (computed in float64, cast back, as NxD). :class:`RouterTopK`
picks the ``k`` largest logits per token (ties to the lower expert index); with ``sigmoid``,
set ``normalize_top_k_affinities`` on the experts so the chosen affinities sum to 1.
:class:`RouterSinkhorn` (top-1) picks ``argmax`` of the Sinkhorn-balanced logits while
training, of the raw logits in eval. Every router returns ``(router_logits (T, E),
expert_affinities (T, E), expert_index (T, top_k))`` and the index carries no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nxd_layers.moe._topk import stable_top_k

__all__ = ["RouterBase", "RouterSinkhorn", "RouterTopK", "sinkhorn"]

_ACTIVATIONS = ("softmax", "sigmoid")


class RouterBase(torch.nn.Module):
    """Shared part of the routers: the linear router and the affinities (NxD's arguments)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        act_fn: str = "softmax",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if act_fn not in _ACTIVATIONS:
            raise ValueError(f"act_fn={act_fn!r}: expected one of {_ACTIVATIONS}")
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.act_fn = act_fn
        self.sequence_parallel_enabled = False
        self.sequence_dimension: int | None = None
        self.linear_router = torch.nn.Linear(
            hidden_size, num_experts, bias=False, dtype=dtype, device=device
        )

    def get_router_logits_and_expert_affinities(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, a)``: logits (T, E) and affinities ``softmax(z)`` or ``sigmoid(z)`` (T, E)."""
        logits = self.linear_router(hidden_states)  # (T, E)
        if self.act_fn == "sigmoid":
            affinities = torch.sigmoid(logits.to(torch.float64))
        else:
            affinities = F.softmax(logits, dim=-1, dtype=torch.float64)
        return logits, affinities.to(hidden_states.dtype)


class RouterTopK(RouterBase):
    """Top-k routing: ``index = topk(z, k)`` (ties to the lower expert index). Train it with
    :func:`~nxd_layers.moe.load_balancing_loss_func`, which penalises imbalance."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        act_fn: str = "softmax",
    ) -> None:
        super().__init__(num_experts, top_k, hidden_size, act_fn, dtype, device)

    def forward(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, affinities = self.get_router_logits_and_expert_affinities(hidden_states)
        return logits, affinities, stable_top_k(logits, self.top_k)


def sinkhorn(cost: torch.Tensor, num_iters: int) -> torch.Tensor:
    """Sinkhorn balancing of ``C = exp(cost)`` (T, E): alternately
    ``d0 = 1 / (T * (C d1))`` and ``d1 = 1 / (E * (d0^T C))``, a fixed number of times (a static
    graph); returns ``diag(d0) C diag(d1)``, whose rows and columns tend to equal sums."""
    if num_iters == 0:
        return cost
    c = torch.exp(cost)
    d0 = torch.ones(c.shape[0], dtype=c.dtype, device=c.device)
    d1 = torch.ones(c.shape[1], dtype=c.dtype, device=c.device)
    eps = 1e-8
    for _ in range(num_iters):
        d0 = 1.0 / (c.shape[0] * ((c * d1).sum(1) + eps))
        d1 = 1.0 / (c.shape[1] * ((d0.unsqueeze(1) * c).sum(0) + eps))
    return d1 * c * d0.unsqueeze(1)


class RouterSinkhorn(RouterBase):
    """Top-1 routing on Sinkhorn-balanced logits while training (plain ``argmax`` in eval);
    ``sinkhorn_iterations`` defaults to 30 (NxD's). ``sinkhorn_tol``, when given, must hold
    after the iterations (an error otherwise)."""

    DEFAULT_SINKHORN_ITERS = 30

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        act_fn: str = "sigmoid",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sinkhorn_iterations: int | None = None,
        sinkhorn_tol: float | None = None,
    ) -> None:
        if top_k != 1:
            raise NotImplementedError(f"RouterSinkhorn routes top-1 only, got top_k={top_k}")
        super().__init__(num_experts, top_k, hidden_size, act_fn, dtype, device)
        self.sinkhorn_iterations = (
            self.DEFAULT_SINKHORN_ITERS if sinkhorn_iterations is None else sinkhorn_iterations
        )
        self.sinkhorn_tol = sinkhorn_tol

    def forward(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, affinities = self.get_router_logits_and_expert_affinities(hidden_states)
        with torch.no_grad():
            scores = logits.detach().to(torch.float32)
            if self.training:
                scores = sinkhorn(scores, self.sinkhorn_iterations)
                if self.sinkhorn_tol is not None:
                    rows = scores.sum(1) * scores.shape[0]
                    error = float((rows - 1).abs().max())
                    if error > self.sinkhorn_tol:
                        raise ValueError(
                            f"Sinkhorn row error {error:.3g} exceeds sinkhorn_tol="
                            f"{self.sinkhorn_tol} after {self.sinkhorn_iterations} iterations"
                        )
        return logits, affinities, stable_top_k(scores, 1)
