"""NxD's ``pipeline.comm`` tensor transfers between neighbouring pipeline ranks.

``send(t)`` on pipeline rank r and ``recv_from(meta)`` on rank r+1 move one tensor forward
(``send_next=False`` / ``recv_prev=False``: backward, r+1 to r), through
:mod:`nxd_state.collectives` (blocking, counted). Ranks wrap around the pipeline group, as in
NxD. The receiver allocates from ``meta``'s ``shape``, ``dtype`` and ``requires_grad`` (NxD's
``TensorMeta`` or any object with those fields) on this process's device
(:func:`nxd_state.current_device`, as NxD's ``get_device()``). NxD's XLA-only arguments
(``all_reduce_send_recv``, ``tracing``) are accepted and have no effect.
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_state import collectives, current_device, get_parallel_state

__all__ = ["recv_from", "send"]


def _neighbour(offset: int) -> tuple[int, Any]:
    state = get_parallel_state()
    p, rank = state.pipeline_parallel_size, state.pipeline_parallel_rank
    return state.pipeline_parallel_ranks[(rank + offset) % p], state.pipeline_parallel_group


def send(
    tensor: torch.Tensor, send_next: bool = True, all_reduce_send_recv: bool = False
) -> torch.Tensor:
    """Send ``tensor`` to the next pipeline rank (the previous with ``send_next=False``)."""
    peer, group = _neighbour(1 if send_next else -1)
    collectives.send(tensor.detach(), peer, group)
    return tensor


def recv_from(
    tensor_meta: Any,
    recv_prev: bool = True,
    tracing: bool = False,
    all_reduce_send_recv: bool = False,
) -> torch.Tensor:
    """Receive a tensor described by ``tensor_meta`` from the previous pipeline rank (the next
    with ``recv_prev=False``); it requires grad as the meta says."""
    peer, group = _neighbour(-1 if recv_prev else 1)
    tensor = torch.empty(tuple(tensor_meta.shape), dtype=tensor_meta.dtype, device=current_device())
    collectives.recv(tensor, peer, group)
    return tensor.requires_grad_(bool(tensor_meta.requires_grad))
