"""AdamW whose state stays in fp32 for low-precision params: NxD's ``AdamW_FP32OptimParams``.

The Hugging Face form of AdamW (decoupled weight decay applied after the Adam update), per
param p with gradient g, step t, and β1, β2, ε, lr, λ from its group:

    m <- β1·m + (1-β1)·g            v <- β2·v + (1-β2)·g²
    α = lr·√(1-β2^t)/(1-β1^t)       (α = lr when ``correct_bias=False``)
    p <- p - α·m/(√v + ε)
    p <- p - lr·λ·p                 (on the updated p)

For bf16/fp16 params, g is promoted to fp32, m and v are kept in fp32 and the update is
computed in fp32 on an fp32 copy of p, then rounded once into p. (NxD gets the same on XLA
with ``XLA_DOWNCAST_BF16=1``, where fp32 tensors live as bf16 and fp64 ones as fp32, by
keeping the state in fp64; on an XLA device with that variable set, so does this one.)

It differs from ``torch.optim.AdamW`` in two ways, as NxD's does: ε is added to √v before the
bias correction (torch adds it to √v/√(1-β2^t)), and the weight decay comes after the update
(torch decays first).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["AdamWFP32OptimParams", "AdamW_FP32OptimParams"]


def _state_dtype(grad: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision gradients (fp64 on XLA under XLA_DOWNCAST_BF16=1), else own."""
    if grad.device.type == "xla" and os.environ.get("XLA_DOWNCAST_BF16", "0") == "1":
        return torch.float64
    if grad.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return grad.dtype


class AdamWFP32OptimParams(Optimizer):
    """AdamW (Hugging Face form) with fp32 state and arithmetic for low-precision params.

    NxD's signature and defaults: ``lr=1e-3``, ``betas=(0.9, 0.999)``, ``eps=1e-6``,
    ``weight_decay=0.0``, ``correct_bias=True``; ``no_deprecation_warning=False`` emits NxD's
    FutureWarning; ``differentiable`` is accepted (the step always runs without autograd) and
    ``capturable`` is kept in the defaults. See the module docstring for the math.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        no_deprecation_warning: bool = True,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        if not no_deprecation_warning:
            warnings.warn(
                "AdamW_FP32OptimParams follows the Hugging Face AdamW, which is deprecated; "
                "torch.optim.AdamW is the maintained implementation (pass "
                "no_deprecation_warning=True to silence this)",
                FutureWarning,
                stacklevel=2,
            )
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{index}] must be in [0, 1), got {beta}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.differentiable = differentiable
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "correct_bias": correct_bias,
            "capturable": capturable,
        }
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts floating state to each param's dtype; here the moments keep
        the dtype they were saved in (fp32 for bf16/fp16 params)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        with torch.no_grad():
            for saved_id, param in zip(saved_ids, params):
                for key, value in state_dict["state"].get(saved_id, {}).items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        self.state[param][key] = value.detach().to(param.device, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every param with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(
                        "AdamW_FP32OptimParams does not support sparse gradients "
                        "(torch.optim.SparseAdam does)"
                    )
                dtype = _state_dtype(param.grad)
                grad = param.grad.to(dtype)
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        grad, memory_format=torch.preserve_format
                    )
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    step = state["step"]
                    step_size *= math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
                value = param if param.dtype == dtype else param.to(dtype)
                value.addcdiv_(exp_avg, denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    value.add_(value, alpha=-group["lr"] * group["weight_decay"])
                if value is not param:
                    param.copy_(value)  # one rounding into the low-precision param
        return loss


# NxD's spelling (neuronx_distributed.utils.adamw_fp32_optim_params.AdamW_FP32OptimParams).
AdamW_FP32OptimParams = AdamWFP32OptimParams
