"""optimum-neuron's ``ParallelizersManager``: the parallelizer of a model type."""

from __future__ import annotations

from typing import Any, ClassVar

from nxd_trainer.hf.families import (
    LlamaParallelizer,
    MistralParallelizer,
    Qwen2Parallelizer,
    Qwen3Parallelizer,
)
from nxd_trainer.hf.parallelizer import Parallelizer

__all__ = ["ParallelizersManager"]


def _model_type(model_type_or_model: Any) -> str:
    if isinstance(model_type_or_model, str):
        return model_type_or_model
    model_type = getattr(getattr(model_type_or_model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        raise TypeError(
            f"expected a model type (str) or a Hugging Face model with config.model_type, got "
            f"{type(model_type_or_model).__name__}"
        )
    return model_type


class ParallelizersManager:
    """Which model types can be parallelised, and by which :class:`Parallelizer`."""

    _PARALLELIZERS: ClassVar[dict[str, type[Parallelizer]]] = {
        cls.spec.model_type: cls
        for cls in (LlamaParallelizer, MistralParallelizer, Qwen2Parallelizer, Qwen3Parallelizer)
    }

    @classmethod
    def get_supported_model_types(cls) -> list[str]:
        """The supported ``config.model_type`` values."""
        return sorted(cls._PARALLELIZERS)

    @classmethod
    def is_model_supported(cls, model_type_or_model: Any) -> tuple[bool, bool, bool]:
        """(tensor parallelism, sequence parallelism on top of it, pipeline parallelism)."""
        parallelizer = cls._PARALLELIZERS.get(_model_type(model_type_or_model))
        if parallelizer is None:
            return (False, False, False)
        spec = parallelizer.spec
        return (True, spec.supports_sequence_parallel, spec.supports_pipeline_parallel)

    @classmethod
    def parallelizer_for_model(cls, model_type_or_model: Any) -> type[Parallelizer]:
        """The parallelizer class of the model (type); an unsupported one is an error listing
        the supported types."""
        model_type = _model_type(model_type_or_model)
        if model_type not in cls._PARALLELIZERS:
            raise NotImplementedError(
                f"model type {model_type!r} is not supported for parallelization; supported "
                f"model types: {cls.get_supported_model_types()}"
            )
        return cls._PARALLELIZERS[model_type]

    @classmethod
    def register(cls, parallelizer: type[Parallelizer]) -> type[Parallelizer]:
        """Add a family (usable as a class decorator): its ``spec.model_type`` maps to it."""
        cls._PARALLELIZERS[parallelizer.spec.model_type] = parallelizer
        return parallelizer
