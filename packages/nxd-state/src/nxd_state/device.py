"""One place that picks the device and the process-group backend.

``cpu`` runs on gloo, ``cuda`` on NCCL and ``xla`` (Trainium through torch-neuronx, TPU, or
the CPU PJRT client) on torch-xla's ``xla`` backend. The choice is, in order: the explicit
argument, the device :func:`init_distributed` initialised this process for (as long as that
process group lives), the ``NXD_DEVICE`` environment variable, ``cpu`` when NxD's
``NXD_CPU_MODE`` is set to a positive integer, ``xla`` when ``PJRT_DEVICE`` is set, ``cuda``
when a GPU is visible, else ``cpu``. So a job started with ``init_distributed(device_type=
"cpu")`` on a machine with a GPU keeps every later choice (``current_device()``, the RNG
tracker, checkpoint staging) on the CPU. torch_xla is imported only when ``xla`` is chosen.

NxD's device helpers live here too: :func:`is_cpu_mode` (NxD's ``cpu_mode()``: the device is
the CPU), :func:`mark_step` (cut the lazy XLA graph; nothing to do elsewhere) and
:func:`get_local_world_size` (processes on this node).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import logging
import os
from typing import Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from nxd_state import health

__all__ = [
    "DeviceType",
    "backend_for",
    "current_device",
    "get_local_world_size",
    "init_distributed",
    "is_cpu_mode",
    "mark_step",
    "move_model_to_device",
    "resolve_device_type",
    "xla_version_mismatch",
]

logger = logging.getLogger(__name__)

DeviceType = Literal["cpu", "cuda", "xla"]
_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "xla": "xla"}


def _cpu_mode_env() -> bool:
    """NxD's ``NXD_CPU_MODE``: an integer, CPU mode when positive (unset or empty: 0)."""
    value = os.environ.get("NXD_CPU_MODE", "").strip()
    if not value:
        return False
    try:
        return int(value) > 0
    except ValueError:
        raise ValueError(
            f"NXD_CPU_MODE must be an integer (1 runs on the CPU, 0 does not), got {value!r}"
        ) from None


# The device init_distributed chose, and the default group it made for it.
_initialised: tuple[object, DeviceType] | None = None


def _initialised_device() -> DeviceType | None:
    """The device :func:`init_distributed` chose, while the group it made is the default."""
    if _initialised is None or not dist.is_initialized():
        return None
    group, kind = _initialised
    return kind if dist.GroupMember.WORLD is group else None


def resolve_device_type(device_type: str | None = None) -> DeviceType:
    """The device type to run on: argument > the device ``init_distributed`` chose >
    ``NXD_DEVICE`` > ``NXD_CPU_MODE`` > ``PJRT_DEVICE`` > cuda > cpu."""
    if device_type is None:
        initialised = _initialised_device()
        if initialised is not None:
            return initialised
    choice = device_type or os.environ.get("NXD_DEVICE")
    if device_type is None and _cpu_mode_env():
        if choice is not None and choice.lower() != "cpu":
            raise ValueError(
                f"NXD_CPU_MODE={os.environ['NXD_CPU_MODE']} asks for the CPU but "
                f"NXD_DEVICE={choice!r} asks for another device: unset one of them"
            )
        choice = "cpu"
    if choice is None:
        if os.environ.get("PJRT_DEVICE"):
            choice = "xla"
        elif torch.cuda.is_available():
            choice = "cuda"
        else:
            choice = "cpu"
    choice = choice.lower()
    if choice not in _BACKENDS:
        raise ValueError(
            f"device type {choice!r} is not supported; expected one of {sorted(_BACKENDS)} "
            f"(set by argument or the NXD_DEVICE environment variable)"
        )
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device type 'cuda' was requested but torch.cuda.is_available() is False"
        )
    return cast(DeviceType, choice)


def is_cpu_mode(device_type: str | None = None) -> bool:
    """Whether this process computes on the CPU (what NxD's ``cpu_mode()`` reports).

    NxD reads only ``NXD_CPU_MODE``; here CPU mode is the resolved device type being ``cpu``,
    so ``NXD_CPU_MODE=1`` still forces it, and a machine with no GPU and no XLA device is in
    CPU mode without it.
    """
    return resolve_device_type(device_type) == "cpu"


def mark_step(device_type: str | None = None) -> None:
    """Cut and run the pending lazy graph on an XLA device (torch-xla's ``sync``, or
    ``xm.mark_step`` on releases without it); on CPU and CUDA, which run eagerly, nothing."""
    if resolve_device_type(device_type) != "xla":
        return
    torch_xla = _import_xla()
    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # older torch-xla, before torch_xla.sync existed
        importlib.import_module("torch_xla.core.xla_model").mark_step()


def get_local_world_size() -> int:
    """Processes on this node: torchrun's ``LOCAL_WORLD_SIZE``.

    Without it (a script started by hand, or a launcher that does not export it) the job is
    taken to run on one node: the default group's world size if one exists, else 1.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is not None:
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {value!r}")
        return size
    return dist.get_world_size() if dist.is_initialized() else 1


def backend_for(device_type: str | None = None) -> str:
    """The torch.distributed backend for a device type: gloo, nccl or xla."""
    return _BACKENDS[resolve_device_type(device_type)]


def xla_version_mismatch(torch_version: str, torch_xla_version: str) -> str | None:
    """The one-line refusal when torch-xla X.Y is installed next to a torch whose (major,
    minor) is not (X, Y); None when they agree or either version is unreadable.

    A torch-xla release is built against one torch minor (torch-xla 2.9 on torch 2.9.x), and
    its wheel's metadata does not pin torch, so ``pip install torch-xla`` beside another torch
    gives an import that dies with an undefined C++ symbol. Local labels (``+cpu``, ``+cu128``)
    and pre-release tails are ignored: only the first two numbers are compared.
    """
    torch_minor, xla_minor = _minor(torch_version), _minor(torch_xla_version)
    if torch_minor is None or xla_minor is None or torch_minor == xla_minor:
        return None
    wanted = f"{xla_minor[0]}.{xla_minor[1]}"
    return (
        f"torch-xla {torch_xla_version} needs torch {wanted}.x, but torch {torch_version} is "
        f"installed: pip install 'torch=={wanted}.*' (or install 'nxd-state[xla]', which pins "
        "both)"
    )


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _import_xla() -> object:
    try:
        xla_version = importlib.metadata.version("torch-xla")
    except importlib.metadata.PackageNotFoundError:  # absent: the import below says so
        xla_version = None
    if xla_version is not None:
        mismatch = xla_version_mismatch(torch.__version__, xla_version)
        if mismatch is not None:
            raise ImportError(mismatch)
    try:
        return importlib.import_module("torch_xla")
    except ImportError as error:
        raise ImportError(
            "device type 'xla' needs torch-xla: pip install 'nxd-state[xla]' "
            "(on Trainium, torch-neuronx from the Neuron package repository)"
        ) from error


def current_device(device_type: str | None = None) -> torch.device:
    """The device this process computes on (``cuda:LOCAL_RANK`` for CUDA)."""
    kind = resolve_device_type(device_type)
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if kind == "xla":
        torch_xla = _import_xla()
        return torch_xla.device()  # type: ignore[attr-defined]
    return torch.device("cpu")


def init_distributed(
    *,
    device_type: str | None = None,
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Initialise the default process group, once, for the device :func:`resolve_device_type`
    picks from ``device_type``; from then on (while that group lives) the process's device is
    that one, whatever the environment shows (a visible GPU, ``PJRT_DEVICE``).

    Under ``torchrun`` (``WORLD_SIZE`` in the environment) this rendezvouses through ``env://``;
    without it the process is a world of one, so the same script runs unlaunched. Calling it
    again when a group already exists does nothing.

    ``timeout`` bounds every collective (gloo: each operation; NCCL: its watchdog aborts the
    communicator): by default ``NXD_COLLECTIVE_TIMEOUT_S``, else 30 minutes
    (:func:`nxd_state.health.collective_timeout`), so a dead or stuck rank ends the job
    instead of hanging it. Each rank is then recorded in the rendezvous store
    (:func:`nxd_state.health.install`) so a failed collective names the rank that caused it.
    """
    if dist.is_initialized():
        return
    kind = resolve_device_type(device_type)
    backend = backend or _BACKENDS[kind]
    timeout = timeout or health.collective_timeout()
    health.set_group_timeout(timeout)
    if kind == "cuda":
        torch.cuda.set_device(current_device(kind))
    if backend == "xla":
        _import_xla()
        importlib.import_module("torch_xla.distributed.xla_backend")
        init_method = init_method or "xla://"
    if init_method is None and "WORLD_SIZE" not in os.environ:
        logger.info("no WORLD_SIZE in the environment: running as a world of one on %s", backend)
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        _remember(kind)
        return
    dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout)
    _remember(kind)
    health.install()
    logger.info(
        "initialised %s process group: rank %d of %d",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )


def _remember(kind: DeviceType) -> None:
    global _initialised
    _initialised = (dist.GroupMember.WORLD, kind)


def move_model_to_device(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Move ``model`` to ``device`` in place, keeping the attributes set on its parameters.

    Parallel layers tag parameters with their sharding (``tensor_model_parallel``,
    ``partition_dim``, ...); a conversion that swaps parameter objects would drop them, so
    they are copied onto whatever parameter ends up in the module.
    """
    saved = {name: dict(vars(param)) for name, param in model.named_parameters()}
    model.to(device)
    for name, param in model.named_parameters():
        for key, value in saved.get(name, {}).items():
            if not hasattr(param, key):
                setattr(param, key, value)
    return model
