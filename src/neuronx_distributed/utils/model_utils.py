"""NxD's ``neuronx_distributed.utils.model_utils``: moving models and a few model predicates."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from nxd_state import get_local_world_size, move_model_to_device

__all__ = [
    "get_local_world_size",
    "init_on_device",
    "is_hf_pretrained_model",
    "is_hf_transformers_available",
    "move_model_to_device",
]


def is_hf_transformers_available() -> bool:
    """Whether ``transformers`` can be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def is_hf_pretrained_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel``."""
    if not is_hf_transformers_available():
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Parameters (and buffers with ``include_buffers``) created inside are put on ``device``;
    with ``torch.device("meta")`` a model is built without allocating its weights.

    Other tensors created inside stay where they would be unless ``include_buffers`` is set,
    in which case every factory call defaults to ``device`` (torch's device context).
    """
    target = torch.device(device)
    if include_buffers:
        with target:
            yield
        return
    register = nn.Module.register_parameter

    def register_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device != target:
            moved = module._parameters[name]
            assert moved is not None
            new = type(moved)(moved.to(target), requires_grad=moved.requires_grad)
            new.__dict__.update(moved.__dict__)  # keep parallel attributes
            module._parameters[name] = new

    nn.Module.register_parameter = register_on_device  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
