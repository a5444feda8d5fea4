"""Gradient norm and clipping over sharded parameters; sequence-parallel gradient sums.

||g||_p = (sum over every distinct element e of the full model of |g_e|^p)^(1/p). Each rank
adds its TP-sharded gradients (divided by ``tensor_parallel_replicas`` when K/V replicas hold
the same element several times) and its replicated gradients only on TP rank 0, then sums
over TP (and PP when given). ``p = inf`` takes maxima instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup, ReduceOp

from nxd_layers._attributes import param_is_not_tensor_parallel_duplicate
from nxd_state import collectives, model_parallel_is_initialized

__all__ = ["allreduce_sequence_parallel_gradients", "clip_grad_norm", "get_grad_norm"]

logger = logging.getLogger(__name__)

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does.
_CLIP_EPS = 1e-6


def _as_list(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _parse_norm_type(norm_type: float | int | str) -> float:
    value = float(norm_type)  # accepts "inf"
    if math.isnan(value) or value <= 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return value


def _default_tp_group(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is not None:
        return group
    if model_parallel_is_initialized():
        from nxd_state import get_parallel_state

        return get_parallel_state().tensor_parallel_group
    return None


def get_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float | int | str = 2,
    *,
    tensor_parallel_group: ProcessGroup | None = None,
    pipeline_parallel_group: ProcessGroup | None = None,
    data_parallel_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """||g||_p over the full (unsharded) model, as a float32 scalar on the gradients' device.

    ``data_parallel_group`` is for gradients sharded over data-parallel ranks (ZeRO-1: each
    rank holds a disjoint slice), summed over like pipeline stages; plain DP replicas hold
    the same gradients and must not pass it.
    """
    p = _parse_norm_type(norm_type)
    params = [param for param in _as_list(parameters) if param.grad is not None]
    tp_group = _default_tp_group(tensor_parallel_group)
    tp_rank = collectives.group_rank(tp_group) if tp_group is not None else 0
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for param in params:
        if not param_is_not_tensor_parallel_duplicate(param, tp_rank):
            continue
        grad = param.grad.detach().float()
        if p == math.inf:
            total = torch.maximum(total, grad.abs().max() if grad.numel() else total)
        else:
            powered = grad.abs().pow(p)
            replicas = getattr(param, "tensor_parallel_replicas", 1)
            if isinstance(replicas, torch.Tensor):  # per-row copy counts (fused QKV)
                rows = powered.reshape(replicas.numel(), -1).sum(dim=1)
                total = total + (rows / replicas.to(rows.device)).sum()
            else:
                total = total + powered.sum() / replicas
    op = ReduceOp.MAX if p == math.inf else ReduceOp.SUM
    if tp_group is not None:
        collectives.all_reduce(total, group=tp_group, op=op)
    for group in (pipeline_parallel_group, data_parallel_group):
        if group is not None:
            collectives.all_reduce(total, group=group, op=op)
    return total if p == math.inf else total.pow(1.0 / p)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float | int,
    norm_type: float | int | str = 2,
    *,
    tensor_parallel_group: ProcessGroup | None = None,
    pipeline_parallel_group: ProcessGroup | None = None,
    data_parallel_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """g <- g * min(1, max_norm / (||g||_p + 1e-6)); returns ||g||_p before clipping.

    The norm is that of the full model (see :func:`get_grad_norm`), so every TP/PP rank
    scales by the same factor. ``tensor_parallel_group`` defaults to the current state's TP
    group; the PP group, and the DP group of ZeRO-1-sharded gradients, are reduced over only
    when given.
    """
    if float(max_norm) < 0 or math.isnan(float(max_norm)):
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    params = _as_list(parameters)
    total_norm = get_grad_norm(
        params,
        norm_type,
        tensor_parallel_group=tensor_parallel_group,
        pipeline_parallel_group=pipeline_parallel_group,
        data_parallel_group=data_parallel_group,
    )
    # No host sync (XLA-friendly): scale by min(1, coef) whether or not clipping is needed.
    clip_coef = torch.clamp(float(max_norm) / (total_norm + _CLIP_EPS), max=1.0)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("gradient norm %.4g, max_norm %s", float(total_norm), max_norm)
    for param in params:
        if param.grad is not None:
            param.grad.detach().mul_(clip_coef.to(param.grad.device, param.grad.dtype))
    return total_norm


def allreduce_sequence_parallel_gradients(
    parameters: Iterable[torch.Tensor], group: ProcessGroup | None = None
) -> None:
    """g <- sum over TP of g, for parameters marked ``sequence_parallel_enabled``.

    Under sequence parallelism a replicated parameter (a norm weight) sees only this rank's
    sequence shard, so its gradient is partial. The gradients are flattened into one buffer
    per dtype and reduced with one all-reduce each.
    """
    tp_group = _default_tp_group(group)
    if tp_group is None:
        raise RuntimeError(
            "allreduce_sequence_parallel_gradients needs a tensor parallel group: pass group= "
            "or call nxd_state.initialize_model_parallel first"
        )
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in parameters:
        if getattr(param, "sequence_parallel_enabled", False) and param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        collectives.all_reduce(flat, group=tp_group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
