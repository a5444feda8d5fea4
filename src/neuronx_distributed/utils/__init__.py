"""NxD's ``neuronx_distributed.utils``: device helpers that also work off XLA.

``cpu_mode()`` is true when nxd computes on the CPU (``NXD_CPU_MODE=1`` still forces it, as in
NxD); ``mark_step()`` runs the pending lazy graph on XLA and does nothing on CPU and CUDA, so an
NxD training loop keeps its ``xm.mark_step()`` calls as ``mark_step()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import nxd_state

__all__ = ["cpu_mode", "get_device", "mark_step", "master_print"]


def cpu_mode() -> bool:
    """Whether this process computes on the CPU."""
    return nxd_state.is_cpu_mode()


def mark_step() -> None:
    """Cut the lazy graph on XLA (``torch_xla.sync``); a no-op on CPU and CUDA."""
    nxd_state.mark_step()


def get_device() -> torch.device:
    """The device this process computes on (CPU, ``cuda:LOCAL_RANK`` or the XLA device)."""
    return nxd_state.current_device()


def master_print(message: object) -> None:
    """Print on global rank 0 only (every rank when no process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
