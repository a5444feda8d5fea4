"""The accelerator the NxD strategy brings on XLA devices (Trainium through torch-neuronx).

Lightning's own ``XLAAccelerator`` may only be paired with Lightning's ``XLAStrategy``, whose
launcher (``xmp.spawn``) and gradient reduction (``xm.optimizer_step`` all-reduces over the
world) are not NxD's: the optimizer wrapper reduces over data parallelism only. This
accelerator only places the process on its XLA device; processes are started by ``torchrun``
(as on Trainium) and every collective goes through ``nxd_state``. torch_xla is imported only
when an instance is used.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator

import nxd_state

__all__ = ["NxDXLAAccelerator"]


class NxDXLAAccelerator(Accelerator):
    """One XLA device per process (``torch_xla.device()``), no device statistics."""

    def setup_device(self, device: torch.device) -> None:
        nxd_state.current_device("xla")  # imports torch_xla, or a clear error without it

    def teardown(self) -> None:
        pass

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}

    @staticmethod
    def parse_devices(devices: Any) -> Any:
        if devices == "auto":
            return NxDXLAAccelerator.auto_device_count()
        return devices

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        count = devices if isinstance(devices, int) else len(devices)
        return [torch.device("xla", i) for i in range(count)]

    @staticmethod
    def auto_device_count() -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    @staticmethod
    def is_available() -> bool:
        return nxd_state.resolve_device_type() == "xla"

    @staticmethod
    def name() -> str:
        return "nxd_xla"
