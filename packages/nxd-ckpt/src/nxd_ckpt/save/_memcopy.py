"""Copies into the async-save host buffer: one ``memcpy`` per contiguous tensor.

torch's CPU ``copy_`` splits a large copy over its OpenMP threads. On a loaded machine (every
core busy, as when training ranks share a host) the parallel region waits for descheduled
threads: copying tens of MB into the host buffer took 10-20 times longer than one plain
``memcpy`` (measured with ``bench/checkpoint.py`` on a shared 2-core machine). A memory copy
is bandwidth-bound, so one thread loses little where cores are free. ``ctypes.memmove``
releases the GIL while it copies.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["copy_into"]


def _plain(tensor: torch.Tensor) -> bool:
    """A dense, contiguous CPU tensor whose memory holds its values as they read."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[...] = source`` (same shape); one ``memcpy`` when both are plain CPU tensors
    of one dtype, else ``target.copy_(source)``. ``target`` is the host buffer: its version
    counter is not bumped by the ``memcpy``."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"copy of shape {tuple(source.shape)} into {tuple(target.shape)}")
    if target.dtype == source.dtype and _plain(target) and _plain(source):
        nbytes = source.numel() * source.element_size()
        if nbytes:
            ctypes.memmove(target.data_ptr(), source.data_ptr(), nbytes)
        return
    target.copy_(source)
