"""The strategy's collectives, all through ``nxd_state.collectives``.

Lightning asks a strategy for four of them: ``reduce`` (metrics with ``sync_dist``, boolean
decisions such as "any rank wants to stop"), ``all_gather``, ``broadcast`` of a Python object
(checkpoint folders, log directories) and ``barrier``. Objects are broadcast as JSON (UTF-8
bytes in a uint8 tensor, its length first): what Lightning broadcasts is paths, numbers, flags
and None, and JSON never executes code on the receiving rank.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed import ReduceOp

from nxd_state import collectives

__all__ = ["all_gather_stacked", "broadcast_object", "reduce_tensor"]

_SUM_ALIASES = ("sum",)
_MEAN_ALIASES = ("mean", "avg")


def reduce_tensor(
    tensor: torch.Tensor, group: Any, reduce_op: Any, world_size: int
) -> torch.Tensor:
    """``op`` over the ranks of ``group`` (the world when None) of a copy of ``tensor``.

    ``reduce_op``: ``"mean"`` / ``"avg"`` (sum / n), ``"sum"``, or a ``torch.distributed.ReduceOp``
    (SUM, MAX, MIN, PRODUCT, AVG).
    """
    out = tensor.detach().clone()
    if not out.is_floating_point() and reduce_op in (*_MEAN_ALIASES, ReduceOp.AVG):
        out = out.float()
    if isinstance(reduce_op, str):
        op_name = reduce_op.lower()
        if op_name not in (*_SUM_ALIASES, *_MEAN_ALIASES):
            raise ValueError(
                f"reduce_op {reduce_op!r} is not supported; expected 'sum', 'mean', 'avg' or a "
                f"torch.distributed.ReduceOp"
            )
        collectives.all_reduce(out, group=group, op=ReduceOp.SUM)
        return out / world_size if op_name in _MEAN_ALIASES else out
    if reduce_op is None or reduce_op == ReduceOp.SUM:
        return collectives.all_reduce(out, group=group, op=ReduceOp.SUM)
    if reduce_op == ReduceOp.AVG:  # gloo has no AVG: sum, then divide
        return collectives.all_reduce(out, group=group, op=ReduceOp.SUM) / world_size
    return collectives.all_reduce(out, group=group, op=reduce_op)


def all_gather_stacked(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``stack([x_0, ..., x_{n-1}])``: every rank's tensor (same shape), in rank order."""
    return collectives.all_gather(tensor.detach().contiguous().unsqueeze(0), group=group, dim=0)


def broadcast_object(obj: Any, src: int, rank: int, device: torch.device) -> Any:
    """``obj`` of global rank ``src`` on every rank, as JSON (tuples come back as lists)."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    payload = b""
    if rank == src:
        try:
            payload = json.dumps(obj).encode("utf-8")
        except TypeError as error:
            raise TypeError(
                f"the NxD strategy broadcasts JSON values only (paths, numbers, flags, None, "
                f"lists and dicts of them), got {type(obj).__qualname__}: {error}"
            ) from error
        length.fill_(len(payload))
    collectives.broadcast(length, src=src)
    data = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if rank == src:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    collectives.broadcast(data, src=src)
    return obj if rank == src else json.loads(bytes(data.cpu().tolist()).decode("utf-8"))
