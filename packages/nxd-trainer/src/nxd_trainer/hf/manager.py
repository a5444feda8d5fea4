"""optimum-neuron's ``ParallelizersManager``: the parallelizer of a model type."""

from __future__ import annotations

from typing import Any, ClassVar

from nxd_trainer.hf._rules import UnsupportedModelError
from nxd_trainer.hf.families import (
    LlamaParallelizer,
    MistralParallelizer,
    Qwen2Parallelizer,
    Qwen3Parallelizer,
)
from nxd_trainer.hf.parallelizer import Parallelizer
from nxd_trainer.hf.plan import plan_parallelizer

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
        try:
            parallelizer = cls.parallelizer_for_model(model_type_or_model)
        except UnsupportedModelError:
            return (False, False, False)
        spec = parallelizer.spec
        return (True, spec.supports_sequence_parallel, spec.supports_pipeline_parallel)

    @classmethod
    def parallelizer_for_model(cls, model_type_or_model: Any) -> type[Parallelizer]:
        """The parallelizer class of the model (type): a registered one (the Llama-family
        path), else one following the tensor-parallel plan transformers declares for it
        (:mod:`nxd_trainer.hf.plan`); a family with neither is an
        :class:`~nxd_trainer.hf.UnsupportedModelError` (a ``NotImplementedError``). Whether
        a plan family's model is reproduced exactly is checked when it is parallelised."""
        model_type = _model_type(model_type_or_model)
        if model_type in cls._PARALLELIZERS:
            return cls._PARALLELIZERS[model_type]
        config = getattr(model_type_or_model, "config", None)
        try:
            return plan_parallelizer(model_type, config)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(
                model_type,
                f"{error.feature}; registered model types: {cls.get_supported_model_types()}",
            ) from None

    @classmethod
    def register(cls, parallelizer: type[Parallelizer]) -> type[Parallelizer]:
        """Add a family (usable as a class decorator): its ``spec.model_type`` maps to it."""
        cls._PARALLELIZERS[parallelizer.spec.model_type] = parallelizer
        return parallelizer
