"""NxD's ``neuronx_distributed.utils.model_utils``: moving models and a few model predicates."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

import nxd_layers
from nxd_state import get_local_world_size, move_model_to_device

__all__ = [
    "get_local_world_size",
    "init_on_device",
    "is_hf_pretrained_model",
    "is_hf_transformers_available",
    "move_model_to_device",
    "preserve_parallel_attributes",
    "reinit_model",
]

# The attributes parallel layers and optimizers set on parameters, kept across re-creation.
_PARALLEL_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "sequence_parallel_enabled",
    "shared",
)


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
def init_on_device(
    device: torch.device | str,
    include_buffers: bool = False,
    force_custom_init_on_device: bool = False,
) -> Iterator[None]:
    """Parameters (and buffers with ``include_buffers``) created inside are put on ``device``;
    with ``torch.device("meta")`` a model is built without allocating its weights
    (:func:`nxd_layers.init_on_device`).

    Other tensors created inside stay where they would be unless ``include_buffers`` is set,
    in which case every factory call defaults to ``device`` (torch's device context).
    ``force_custom_init_on_device`` is accepted for NxD's signature: NxD uses it to avoid
    accelerate's version, which this function never uses; ``requires_grad`` is always kept.
    """
    with nxd_layers.init_on_device(device, include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def preserve_parallel_attributes(model: nn.Module) -> Iterator[None]:
    """Parameters re-created inside the block (``to_empty``, ``reinit_model``, a dtype cast)
    get back the sharding attributes the old ones carried, matched by parameter name."""
    saved = {
        name: {key: getattr(param, key) for key in _PARALLEL_ATTRIBUTES if hasattr(param, key)}
        for name, param in model.named_parameters()
    }
    try:
        yield
    finally:
        for name, param in model.named_parameters():
            for key, value in saved.get(name, {}).items():
                if not hasattr(param, key):
                    setattr(param, key, value)


def reinit_model(
    model: nn.Module, device: torch.device | str, param_init_fn: Callable[[nn.Module], None]
) -> None:
    """Give every parameter fresh storage on ``device`` and run ``param_init_fn(module)`` on each
    module (e.g. to materialise a meta-device model), keeping sharding attributes and ties."""
    ties = _tied_parameter_names(model)
    with preserve_parallel_attributes(model), torch.no_grad():
        model.to_empty(device=device)  # a new Parameter per module: ties are restored below
        for names in ties:
            owner, _, leaf = names[0].rpartition(".")
            shared = getattr(model.get_submodule(owner), leaf)
            for name in names[1:]:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, shared)
        for module in model.modules():
            param_init_fn(module)


def _tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of names (two or more) under which one Parameter object is registered."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
