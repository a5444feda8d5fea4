"""NxD's ``neuronx_distributed.trace.model_builder``: importable, not provided.

NxD's ``ModelBuilder`` compiles several Neuron inference programs (buckets, weight layouts,
``NxDModel`` executables) with neuronx-cc; nxd has no equivalent on the portable route, so its
classes refuse on construction with one clear error instead of half-working. Per-rank tensor
parallel tracing is :func:`neuronx_distributed.trace.parallel_model_trace`.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["BaseModelInstance", "ModelBuilder"]


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(
        f"neuronx_distributed.trace.model_builder.{name} (NxD's Neuron inference builder) is "
        f"not provided by nxd; trace per-rank programs with "
        f"neuronx_distributed.trace.parallel_model_trace(get_model, example_inputs, tp_degree=N)"
    )


class ModelBuilder:
    """NxD's inference program builder: refused (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("ModelBuilder")


class BaseModelInstance:
    """NxD's model-instance holder for ``ModelBuilder``: refused (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("BaseModelInstance")
