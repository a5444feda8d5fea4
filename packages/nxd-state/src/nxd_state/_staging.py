"""Which device a process group's backend needs its tensors on, and the copy that gets them there.

A backend takes tensors on some device types only: gloo on CPU or CUDA, NCCL on CUDA, torch-xla's
``xla`` backend on XLA devices; a group built with several backends (``"cpu:gloo,cuda:nccl"``)
takes the device types it lists. A tensor elsewhere (a CPU flag or loss sum on an NCCL group)
is *staged*: copied to the backend's device (gloo: CPU, NCCL: this process's current CUDA
device, xla: this process's XLA device), the op runs on the copy, and the result is copied
back into the caller's tensor (in-place ops) or moved to the caller's device (ops that return
a new tensor). An unknown backend, or a tensor on a device that holds no data (``meta``), is
passed as it is: the backend says what it thinks of it. Nothing is staged while compiling or
exporting: a captured graph holds its collectives on the devices its tensors are on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "BackendDevices",
    "backend_devices",
    "backend_of",
    "stage",
    "staging_device",
    "staging_device_type",
    "unstage",
]


@dataclass(frozen=True)
class BackendDevices:
    """The device types a backend takes tensors on, and the one it stages others to."""

    accepted: frozenset[str]
    """Device types whose tensors the backend's ops take as they are."""
    staging: str
    """Device type a tensor on any other (data-holding) device is copied to for an op."""


_BACKEND_DEVICES: dict[str, BackendDevices] = {
    "gloo": BackendDevices(frozenset({"cpu", "cuda"}), "cpu"),
    "nccl": BackendDevices(frozenset({"cuda"}), "cuda"),
    "xla": BackendDevices(frozenset({"xla"}), "xla"),
}
# Devices whose tensors hold data that can be copied (a meta tensor has none).
_DATA_DEVICES = frozenset({"cpu", "cuda", "xla"})


def backend_of(group: ProcessGroup | None) -> str:
    """The name torch.distributed gives the backend of ``group`` (default group: None)."""
    return str(dist.get_backend(group)).lower()


def backend_devices(backend: str) -> BackendDevices | None:
    """What ``backend`` takes (None: unknown, tensors passed as they are).

    ``"cpu:gloo,cuda:nccl"`` (one group, a backend per device type) takes the device types it
    lists, as they are; anything else is staged to the first one's device.
    """
    backend = backend.lower()
    if ":" in backend:
        pairs = [part.split(":", 1) for part in backend.split(",") if ":" in part]
        types = [device.strip() for device, _ in pairs]
        return BackendDevices(frozenset(types), types[0]) if types else None
    return _BACKEND_DEVICES.get(backend)


def staging_device_type(backend: str, device_type: str) -> str | None:
    """The device type a tensor on ``device_type`` is copied to for an op on ``backend``;
    None when the backend takes it where it is (or cannot be helped: unknown backend, meta)."""
    devices = backend_devices(backend)
    if devices is None or device_type in devices.accepted or device_type not in _DATA_DEVICES:
        return None
    return devices.staging


def _device(device_type: str) -> torch.device:
    """This process's device of ``device_type`` (CUDA: the current device, what NCCL uses)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device_type == "xla":
        from nxd_state.device import current_device

        return current_device("xla")
    return torch.device(device_type)


def staging_device(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.device | None:
    """Where ``tensor`` must be copied for an op on ``group``; None: it can stay."""
    if torch.compiler.is_compiling():
        return None
    kind = staging_device_type(backend_of(group), tensor.device.type)
    return None if kind is None else _device(kind)


def stage(
    tensor: torch.Tensor, group: ProcessGroup | None, *, copy_data: bool = True
) -> torch.Tensor:
    """``tensor`` itself when ``group``'s backend takes it, else a copy on the backend's device
    (``copy_data=False``: an uninitialised buffer there, for a receive)."""
    device = staging_device(tensor, group)
    if device is None:
        return tensor
    if not copy_data:
        return torch.empty_like(tensor, device=device)
    return tensor.to(device, copy=True)


def unstage(tensor: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """``tensor <- staged`` in place when ``staged`` is a staging copy; returns ``tensor``."""
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor
