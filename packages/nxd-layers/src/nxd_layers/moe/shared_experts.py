"""Shared experts (Qwen-MoE): a dense gated MLP every token goes through, added to the routed
output.

``s(x) = g(x) * ((act(x W_g) * (x W_u)) W_d)`` with the optional gate
``g(x) = sigmoid(x w_s)`` (Qwen2-MoE's ``shared_expert_gate``; 1 without it). Replicated on every
rank (its gradients are averaged over DP like any dense layer).
"""

from __future__ import annotations

import torch

from nxd_layers.moe.model_utils import ACT2FN

__all__ = ["SharedExperts"]


class SharedExperts(torch.nn.Module):
    """``num_shared_experts`` shared experts fused into one MLP of width
    ``num_shared_experts * intermediate_size``, with an optional sigmoid gate."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_shared_experts: int = 1,
        hidden_act: str = "silu",
        gated: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={hidden_act!r}: expected one of {sorted(ACT2FN)}")
        width = num_shared_experts * intermediate_size
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = torch.nn.Linear(hidden_size, width, **kw)  # type: ignore[arg-type]
        self.up_proj = torch.nn.Linear(hidden_size, width, **kw)  # type: ignore[arg-type]
        self.down_proj = torch.nn.Linear(width, hidden_size, **kw)  # type: ignore[arg-type]
        self.act_fn = ACT2FN[hidden_act]
        self.shared_expert_gate = (
            torch.nn.Linear(hidden_size, 1, **kw) if gated else None  # type: ignore[arg-type]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        if self.shared_expert_gate is not None:
            y = torch.sigmoid(self.shared_expert_gate(x)) * y
        return y
