"""What ``compiler_args`` means on each route, and which arguments only the Neuron route takes.

NxD passes ``compiler_args`` to neuronx-cc (a string or a list of ``--flag`` strings). The
portable route compiles nothing by default (each rank runs its ``torch.export`` program); its
options come as an :class:`ExportOptions` (or a dict of its fields), e.g. AOTInductor.
neuronx-cc flags only tune that compiler: off the Neuron route they are ignored with a
warning. A ``torch_neuronx.BucketModelConfig`` and ``states`` change what is traced and need
torch-neuronx: without it they are refused with a clear error instead of being ignored.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["ExportOptions", "neuron_available", "parse_compiler_args"]


def neuron_available() -> bool:
    """Whether torch-neuronx can be imported here (it is never imported at module import)."""
    return importlib.util.find_spec("torch_neuronx") is not None


@dataclass(kw_only=True)
class ExportOptions:
    """The portable route's ``compiler_args``."""

    aot_inductor: bool = False
    """Compile each rank's program ahead of time with AOTInductor
    (``torch._inductor.aoti_compile_and_package``) and run the compiled package; the exported
    program is kept too (saved next to it, used where the package cannot be loaded)."""
    inductor_configs: dict[str, Any] = field(default_factory=dict)
    """Options passed to AOTInductor (e.g. ``{"max_autotune": True}``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.aot_inductor, bool):
            raise ValueError(f"aot_inductor must be a bool, got {self.aot_inductor!r}")
        if not isinstance(self.inductor_configs, dict):
            raise ValueError(f"inductor_configs must be a dict, got {self.inductor_configs!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"aot_inductor": self.aot_inductor, "inductor_configs": self.inductor_configs}


def parse_compiler_args(compiler_args: Any) -> tuple[ExportOptions, list[str] | None]:
    """(portable options, neuronx-cc flags or None) from NxD's ``compiler_args``."""
    if compiler_args is None:
        return ExportOptions(), None
    if isinstance(compiler_args, ExportOptions):
        return compiler_args, None
    if isinstance(compiler_args, dict):
        known = {f.name for f in fields(ExportOptions)}
        unknown = sorted(set(compiler_args) - known)
        if unknown:
            raise ValueError(
                f"compiler_args has unknown keys {unknown}; the portable route takes "
                f"{sorted(known)}"
            )
        return ExportOptions(**compiler_args), None
    if isinstance(compiler_args, str):
        return ExportOptions(), compiler_args.split()
    if isinstance(compiler_args, list | tuple) and all(isinstance(a, str) for a in compiler_args):
        return ExportOptions(), list(compiler_args)
    raise ValueError(
        "compiler_args must be neuronx-cc flags (a string or a list of strings, Neuron route), "
        f"an ExportOptions or a dict of its fields, got {compiler_args!r}"
    )
