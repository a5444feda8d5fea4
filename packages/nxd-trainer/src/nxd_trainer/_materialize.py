"""Building the model without ever holding more than this rank's part of it.

Meta-device init: ``model_fn`` runs under ``nxd_layers.init_on_device(meta)``, so every
parameter it registers has a shape and no storage and the TP layers draw no master weight
(buffers too with ``include_buffers``). :func:`materialize_meta_module` then gives each meta
parameter storage on the target device (one tensor per parameter, so tied weights stay tied;
sharding attributes kept) and calls ``param_init_fn`` on every module, as NxD does. Under
pipeline parallelism :class:`nxd_pipeline.NxDPPModel` does it for the local stages only.

Waves: ``sequential_move_factor = f`` lets the ranks of a node build in waves of ``f`` local
ranks (wave ``k`` = local ranks ``k·f .. k·f + f − 1``), a world barrier between waves, so at
most ``f`` processes of a node hold a model being built at once.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed import ReduceOp

from nxd_state import collectives

__all__ = ["as_module_init", "build_in_waves", "materialize_meta_module"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def as_module_init(
    param_init_fn: Callable[..., Any] | None, device: torch.device
) -> Callable[[nn.Module], None] | None:
    """``param_init_fn`` as a one-argument function: NxD's ``fn(module)`` is kept as is, a
    ``fn(module, device)`` gets ``device`` bound."""
    if param_init_fn is None:
        return None
    try:
        parameters = inspect.signature(param_init_fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: NxD's one-argument form
        return param_init_fn
    positional = [
        p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    if len(required) >= 2:
        return lambda module: param_init_fn(module, device)
    return param_init_fn


def materialize_meta_module(
    model: nn.Module,
    device: torch.device,
    init: Callable[[nn.Module], None],
    *,
    every_module: bool = True,
) -> int:
    """Allocate every meta parameter of ``model`` on ``device`` and initialise it; returns how
    many parameters were materialised.

    ``init(module)`` is called, parents first, on every module of ``model`` (NxD's rule: a
    ``param_init_fn`` may replace a child, e.g. a rotary embedding whose tables are on
    ``meta``), or with ``every_module=False`` once per module owning a meta parameter or a
    meta buffer; each module's parameters are already allocated (uninitialised) when it is
    given. It fills them and must set (or replace the owners of) the meta buffers, which are
    an error if still on ``meta`` afterwards.
    """
    replaced: dict[int, nn.Parameter] = {}
    owners: list[nn.Module] = []
    for module in model.modules():
        owns = False
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                new = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=param.requires_grad,
                )
                new.__dict__.update(param.__dict__)  # tensor_model_parallel, partition_dim ...
                replaced[id(param)] = new
            module._parameters[name] = replaced[id(param)]
            owns = True
        if owns or any(b is not None and b.is_meta for b in module._buffers.values()):
            owners.append(module)
    with torch.no_grad():
        if every_module:
            for module in model.modules():  # live: a child a parent replaced is visited
                init(module)
        else:
            for module in owners:
                init(module)
    still_meta = [name for name, b in model.named_buffers() if b.is_meta]
    if still_meta:
        raise ValueError(
            f"buffers {still_meta[:8]} are still on the meta device after param_init_fn: "
            f"param_init_fn(module) must also set the meta buffers of the module it is given "
            f"(or build the model with include_buffers=False: buffers then keep their values)"
        )
    unset = [name for name, p in model.named_parameters() if p.is_meta]
    if unset:
        raise ValueError(
            f"parameters {unset[:8]} are on the meta device after param_init_fn: a module "
            f"param_init_fn created holds meta parameters"
        )
    logger.info("materialised %d meta parameters on %s", len(replaced), device)
    return len(replaced)


def _local_rank_and_size() -> tuple[int, int]:
    """This process's rank on its node and the node's process count (torchrun's variables)."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    size = int(os.environ.get("LOCAL_WORLD_SIZE", str(rank + 1)))
    return rank, max(size, rank + 1)


def build_in_waves(factor: int, work: Callable[[], T], flag_device: torch.device) -> T:
    """Run ``work`` in waves of ``factor`` local ranks; every rank learns whether any failed.

    A rank whose ``work`` raises keeps joining the waves' barriers, then all ranks exchange a
    failure flag (one 4-byte all-reduce), so a failure anywhere raises everywhere instead of
    leaving the other ranks blocked in their next collective.
    """
    local_rank, local_size = _local_rank_and_size()
    waves = math.ceil(local_size / factor)
    result: Any = None
    error: BaseException | None = None
    for wave in range(waves):
        if local_rank // factor == wave:
            logger.info("building the model (wave %d of %d)", wave + 1, waves)
            try:
                result = work()
            except Exception as caught:  # re-raised below, after the other ranks know
                error = caught
        if waves > 1:
            collectives.barrier()
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=flag_device)
    if torch.distributed.is_initialized():
        collectives.all_reduce(failed, op=ReduceOp.MAX)
    if error is not None:
        raise error
    if int(failed.item()):
        raise RuntimeError(
            "initialize_parallel_model failed on another rank (its error is raised there)"
        )
    return result
