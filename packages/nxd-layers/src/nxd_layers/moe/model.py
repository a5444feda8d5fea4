"""The MoE layer: route, run the experts (sharded over EP), add the shared experts.

``y = sum_{kept (t, e)} w_te E_e(x_t) + s(x_t)`` for the tokens ``x`` (..., H) flattened to
(T, H); see :mod:`~nxd_layers.moe.routing`, :mod:`~nxd_layers.moe.experts` and
:mod:`~nxd_layers.moe.shared_experts`. Returns NxD's tuple: ``(output,)`` then
``router_logits`` (T, E) with ``return_router_logits`` (for
:func:`~nxd_layers.moe.load_balancing_loss_func`), then ``expert_index`` (T, k) when
``MoE.is_test``.

Each rank routes its own tokens; with EP the capacity and the tie order are those of the EP
group's concatenated batch (rank-major), so a batch-first input split over the EP ranks'
batch dimension gives the one-process layer's output exactly.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from nxd_layers.moe.experts import ExpertMLPs
from nxd_layers.moe.routing import RouterBase
from nxd_layers.moe.shared_experts import SharedExperts

__all__ = ["MoE"]


class MoE(torch.nn.Module):
    """NxD's ``MoE(router, expert_mlps, ...)``; ``shared_experts`` is nxd's addition.

    Sequence parallelism is not supported inside the layer (``sequence_parallel_enabled``
    must be False: gather the sequence first); ``token_shuffle_group_size`` must be 1.
    """

    is_test = False

    def __init__(
        self,
        router: RouterBase,
        expert_mlps: ExpertMLPs,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        return_router_logits: bool = False,
        token_shuffle_group_size: int = 1,
        token_shuffle_seed: int | None = None,
        tensor_model_parallel_group: ProcessGroup | None = None,
        shared_experts: SharedExperts | None = None,
    ) -> None:
        super().__init__()
        for attr in ("num_experts", "top_k", "hidden_size"):
            if getattr(router, attr) != getattr(expert_mlps, attr):
                raise ValueError(
                    f"{attr}: router has {getattr(router, attr)}, expert_mlps has "
                    f"{getattr(expert_mlps, attr)}"
                )
        if sequence_parallel_enabled:
            raise NotImplementedError(
                "sequence_parallel_enabled=True: nxd's MoE layer takes the full sequence "
                "(gather it before the layer)"
            )
        if token_shuffle_group_size != 1:
            raise NotImplementedError(
                f"token_shuffle_group_size={token_shuffle_group_size}: nxd's MoE does not "
                f"shuffle tokens (use 1)"
            )
        del sequence_dimension, token_shuffle_seed, tensor_model_parallel_group
        self.router = router
        self.expert_mlps = expert_mlps
        self.shared_experts = shared_experts
        self.sequence_parallel_enabled = False
        self.return_router_logits = return_router_logits

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (T, H)
        router_logits, affinities, expert_index = self.router(x)
        out = self.expert_mlps(x, affinities, expert_index)  # (T, H)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        result: tuple[torch.Tensor, ...] = (out.view(shape),)
        if self.return_router_logits:
            result += (router_logits,)
        if self.is_test:
            result += (expert_index,)
        return result
