"""What graph capture produces (:class:`CapturedGraph`) and how it fails
(:class:`PipelineTraceError`)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

from torch import fx

__all__ = ["CapturedGraph", "PipelineTraceError", "failure_site"]


class PipelineTraceError(RuntimeError):
    """Graph capture failed; the message names the module and the operation, and what to do."""


@dataclass(kw_only=True)
class CapturedGraph:
    """A flat graph of the model's forward."""

    graph_module: fx.GraphModule
    """The traced module; its graph's targets are the original model's qualified names."""
    input_names: list[str]
    """Placeholders, in order: the keyword arguments ``run_train`` / ``run_eval`` take."""
    route: str
    """``"fx"`` or ``"export"``."""
    output_spec: Any = None
    """Export route: the pytree spec that rebuilds the model's output from the flat outputs."""
    fixed_inputs: dict[str, Any] = field(default_factory=dict)
    """Inputs fixed at capture time (``use_cache=False``), supplied when the caller omits them."""
    module_calls: list[str] = field(default_factory=list)
    """Modules that run as one ``call_module`` node (the real module is called, so hooks,
    patched ``forward`` methods and activation checkpointing apply to it), in graph order."""


def failure_site(error: BaseException) -> str:
    """The innermost frame of the traceback outside torch and nxd_pipeline's capture code:
    where user code did the operation."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = ("_trace.py", "_export.py", "_captured.py")
    outside = [f for f in frames if "/torch/" not in f.filename and not f.filename.endswith(ours)]
    frame = outside[-1] if outside else (frames[-1] if frames else None)
    if frame is None:
        return "an unknown location"
    return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
