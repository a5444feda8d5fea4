"""The Neuron route: each rank compiled to a Neuron binary by torch-neuronx (NxD's own way).

Taken when torch-neuronx is importable and the device is XLA (Trainium / Inferentia), or when
a Neuron-only argument is given (neuronx-cc ``compiler_args``, a ``BucketModelConfig``,
``states``). Each worker joins the ``xla`` process group (nxd_state), builds its shard with
``func()`` and calls ``torch_neuronx.trace`` per bucket with the compiler work directory, flags
and ``inline_weights_to_neff``; ranks are saved as TorchScript ``tp_<r>.pt`` (NxD's names) and
loaded with ``torch.jit.load``. **Untested here** (no Neuron hardware or torch-neuronx in CI):
the portable ``torch.export`` route is the tested one. torch-neuronx is imported only inside
these functions.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["load_rank", "require", "save_rank", "trace_rank"]


def require(reason: str) -> Any:
    """``torch_neuronx``, or an ImportError saying which argument needs it."""
    try:
        return importlib.import_module("torch_neuronx")
    except ImportError as error:
        raise ImportError(
            f"{reason} needs torch-neuronx, which is not importable here (install the "
            "`neuron` extra from the Neuron package repository), or drop it to use the "
            "portable torch.export route"
        ) from error


def trace_rank(
    model: nn.Module,
    buckets: list[tuple[Any, ...]],
    rank: int,
    *,
    compiler_workdir: str | None,
    compiler_args: list[str] | None,
    inline_weights_to_neff: bool,
    states: Any = None,
) -> list[Any]:
    """One Neuron-compiled module per bucket for this rank."""
    torch_neuronx = require("the Neuron trace route")
    traced = []
    for bucket, args in enumerate(buckets):
        workdir = None
        if compiler_workdir is not None:
            workdir = str(Path(compiler_workdir) / f"_tp{rank}" / f"_bk{bucket}")
        kwargs: dict[str, Any] = {
            "compiler_workdir": workdir,
            "compiler_args": compiler_args,
            "inline_weights_to_neff": inline_weights_to_neff,
        }
        if states is not None:
            kwargs["states"] = states
        traced.append(torch_neuronx.trace(model, args, **kwargs))
    return traced


def save_rank(modules: list[Any], directory: Path, rank: int) -> dict[str, Any]:
    import torch

    names = []
    for bucket, module in enumerate(modules):
        name = f"tp_{rank}{f'_bucket{bucket}' if bucket else ''}.pt"
        torch.jit.save(module, str(directory / name))
        names.append(name)
    return {"programs": names, "weights": None, "aliases": {}, "groups": {}, "aoti": []}


def load_rank(directory: Path, entry: dict[str, Any]) -> list[Any]:
    import torch

    require("loading a Neuron-traced model")
    return [torch.jit.load(str(directory / name)) for name in entry["programs"]]
