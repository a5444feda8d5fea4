"""Materialise only this rank's parameters of a model built on the meta device.

Every parameter the local stages use that still lives on ``meta`` is replaced, in the model
itself, by an uninitialised tensor on ``device`` (one per parameter, so weights tied inside the
rank stay tied; attributes such as ``tensor_model_parallel`` are kept). ``param_init_fn`` is
then called on each module owning such a parameter, as NxD does: it initialises that module's
own parameters. For a meta buffer the stages read it is then called on the buffer's owner and
its ancestors, parents first, while a meta buffer remains below (NxD's examples replace the
rotary embedding when given its parent); a buffer still on ``meta`` afterwards is an error.
The rest of the model stays on ``meta``: the rank never holds it.

:func:`move_local_tensors` then moves what the local stages hold to the stages' device, one
new tensor per old one, so weights tied inside the rank stay tied there too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["materialize_local_parameters", "model_device", "move_local_tensors"]

logger = logging.getLogger(__name__)


def materialize_local_parameters(
    model: nn.Module,
    stage_parameters: list[dict[str, nn.Parameter]],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    stage_buffers: list[dict[str, torch.Tensor]] | None = None,
) -> bool:
    """Materialise and initialise the meta parameters (and meta buffers) of the local stages;
    True if there were any (the model's parameter and buffer objects were replaced)."""
    wanted = {id(p) for params in stage_parameters for p in params.values()}
    meta = {id(p) for params in stage_parameters for p in params.values() if p.is_meta}
    meta_buffers = {
        name for buffers in stage_buffers or [] for name, b in buffers.items() if b.is_meta
    }
    if not meta and not meta_buffers:
        return False
    if param_init_fn is None:
        raise ValueError(
            f"{len(meta)} local parameters and {len(meta_buffers)} buffers are on the meta "
            f"device: pass param_init_fn "
            f"(called on each module to initialise its own parameters)"
        )
    replaced, owners = _replace_meta_parameters(model, wanted, device)
    ancestry = _buffer_ancestry(meta_buffers)
    with torch.no_grad():
        for module in owners:
            param_init_fn(module)
        done = {id(module) for module in owners}
        for path in ancestry:
            try:
                module = model.get_submodule(path)
            except AttributeError:  # under a module an ancestor replaced
                continue
            if id(module) not in done and any(
                b is not None and b.is_meta for b in module.buffers()
            ):
                done.add(id(module))
                param_init_fn(module)
    still_meta = [name for name in sorted(meta_buffers) if model.get_buffer(name).is_meta]
    if still_meta:
        raise ValueError(
            f"buffers {still_meta} are still on the meta device after param_init_fn: "
            f"param_init_fn must also set the buffers of the modules it is given"
        )
    logger.info("materialised %d local parameters on %s", len(replaced), device)
    return True


def _replace_meta_parameters(
    model: nn.Module, wanted: set[int], device: torch.device
) -> tuple[dict[int, nn.Parameter], list[nn.Module]]:
    """Each wanted meta parameter replaced by an uninitialised one on ``device`` (one object
    per parameter, even when shared), keeping its sharding attributes; and the modules that
    own one, in ``named_modules`` order."""
    replaced: dict[int, nn.Parameter] = {}
    owners: list[nn.Module] = []
    for _, module in model.named_modules():
        owns = False
        for name, param in list(module._parameters.items()):
            if param is None or id(param) not in wanted or not param.is_meta:
                continue
            if id(param) not in replaced:
                new = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=param.requires_grad,
                )
                new.__dict__.update(param.__dict__)  # sharding attributes set by nxd layers
                replaced[id(param)] = new
            module._parameters[name] = replaced[id(param)]
            owns = True
        if owns:
            owners.append(module)
    return replaced, owners


def _buffer_ancestry(meta_buffers: set[str]) -> list[str]:
    """A meta buffer's owner and its ancestors, parents first (NxD's rule: param_init_fn may
    replace a child, e.g. a rotary embedding, when given its parent); each is looked up by
    name when its turn comes, so a replaced child is the new one."""
    ancestry: list[str] = []
    for name in sorted(meta_buffers):
        parts = name.split(".")[:-1]
        for depth in range(len(parts) + 1):
            path = ".".join(parts[:depth])
            if path not in ancestry:
                ancestry.append(path)
    ancestry.sort(key=lambda path: path.count(".") + (path != ""))
    return ancestry


def model_device(*modules: nn.Module) -> torch.device:
    """Where the first parameter is; CPU for a parameterless or meta model."""
    param = next((p for module in modules for p in module.parameters()), None)
    if param is None or param.device.type == "meta":
        return torch.device("cpu")
    return param.device


@torch.no_grad()
def move_local_tensors(modules: list[nn.Module], device: torch.device) -> int:
    """Move every parameter and buffer of ``modules`` to ``device``; returns how many moved.

    A parameter keeps its identity where torch allows it (``p.data = moved``: CPU <-> CUDA);
    otherwise (XLA) it is replaced, once, in every module holding it: tied weights stay one
    tensor (``module.to`` would convert each holder separately) and keep their attributes.
    """
    moved: dict[int, torch.Tensor] = {}
    for module in modules:
        for sub in module.modules():
            for slots in (sub._parameters, sub._buffers):
                for name, tensor in list(slots.items()):
                    if tensor is None or tensor.device == device:
                        continue
                    if id(tensor) not in moved:
                        moved[id(tensor)] = _moved(tensor, device)
                    slots[name] = moved[id(tensor)]  # type: ignore[assignment]
    if moved:
        logger.info("moved %d local tensors to %s", len(moved), device)
    return len(moved)


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    value = tensor.detach().to(device)
    if not isinstance(tensor, nn.Parameter):
        return value
    try:
        tensor.data = value
        return tensor
    except RuntimeError:  # incompatible tensor types (e.g. CPU -> XLA): a new parameter
        new = nn.Parameter(value, requires_grad=tensor.requires_grad)
        new.__dict__.update(tensor.__dict__)
        return new
