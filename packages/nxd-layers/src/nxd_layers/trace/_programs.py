"""One rank's programs: capture with ``torch.export``, the process groups their collectives
name, renaming those groups in a loaded program, and the optional AOTInductor compile.

nxd's layers issue their collectives through ``nxd_state.collectives``, i.e. ``torch.distributed``'s
in-place ops; non-strict ``torch.export`` (torch >= 2.9) redirects those to the functional
collectives (``torch.ops._c10d_functional.all_reduce`` + ``wait_tensor``), so the captured graph
holds the communication itself and needs no hook in nxd_state. A functional collective names
its process group by a string (``"1"``), which only means something in the process that
created the group: :func:`collective_groups` records each name's ranks at capture, and
:func:`rename_groups` points a loaded program at the matching groups of the new process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.export import ExportedProgram

__all__ = [
    "alias_groups",
    "collective_groups",
    "compile_aoti",
    "export_program",
    "load_aoti",
    "rename_groups",
    "runner",
]

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

logger = logging.getLogger("nxd_layers.trace")
_COLLECTIVE_NAMESPACE = "_c10d_functional"


def export_program(model: nn.Module, args: tuple[Any, ...]) -> ExportedProgram:
    """Y = model(*args) captured as an ATen graph (non-strict: the Python runs, collectives are
    recorded as functional ops)."""
    with torch.no_grad():
        return torch.export.export(model, args, strict=False)


def _group_name(node: torch.fx.Node, index: int) -> GroupName:
    """The ``group_name`` argument at ``index`` (a ``str`` in the functional-collective
    schemas, see :func:`_collective_nodes`)."""
    return cast("GroupName", node.args[index])


def _collective_nodes(program: ExportedProgram) -> list[tuple[torch.fx.Node, int]]:
    """Every functional-collective call and the position of its ``group_name`` argument."""
    found = []
    for node in program.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        if node.target.namespace != _COLLECTIVE_NAMESPACE:
            continue
        for index, argument in enumerate(node.target._schema.arguments):
            if argument.name == "group_name" and index < len(node.args):
                found.append((node, index))
    return found


def collective_groups(program: ExportedProgram) -> dict[str, list[int]]:
    """{group name: its global ranks} for every group the program's collectives use."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    groups: dict[str, list[int]] = {}
    for node, index in _collective_nodes(program):
        name = _group_name(node, index)
        if name not in groups:
            groups[name] = dist.get_process_group_ranks(_resolve_process_group(name))
    return groups


def rename_groups(program: ExportedProgram, names: dict[str, str]) -> None:
    """Point the program's collectives from the recorded group names to ``names[old]``."""
    changed = False
    for node, index in _collective_nodes(program):
        old = _group_name(node, index)
        if old not in names:
            raise ValueError(f"the program uses process group {old!r}, which its manifest omits")
        if names[old] != old:
            node.args = (*node.args[:index], names[old], *node.args[index + 1 :])
            changed = True
    if changed:
        program.graph_module.recompile()


def alias_groups(names: dict[str, str]) -> None:
    """Make each recorded group name resolve here too (compiled packages bake the names in):
    register it for the group it was mapped to, unless it already names one of the same ranks."""
    from torch.distributed.distributed_c10d import (
        _register_process_group,
        _resolve_process_group,
    )

    for old_name, new_name in names.items():  # names recorded at capture / of this process
        old, new = cast("GroupName", old_name), cast("GroupName", new_name)
        target = _resolve_process_group(new)
        try:
            existing = _resolve_process_group(old)
        except Exception:  # not registered in this process
            _register_process_group(old, target)
            continue
        if dist.get_process_group_ranks(existing) != dist.get_process_group_ranks(target):
            raise ValueError(
                f"process group name {old!r} of the compiled package means ranks "
                f"{dist.get_process_group_ranks(target)} but names ranks "
                f"{dist.get_process_group_ranks(existing)} here; load with "
                "use_aot_inductor=False"
            )


def runner(program: ExportedProgram, device: torch.device) -> Callable[..., Any]:
    """The program as a callable module on ``device`` (its weights: the program's state dict)."""
    module = program.module()
    return module if device.type == "cpu" else module.to(device)


def compile_aoti(program: ExportedProgram, path: Path, configs: dict[str, Any]) -> float:
    """Compile ``program`` with AOTInductor into the package ``path``; returns seconds taken."""
    start = time.perf_counter()
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs=dict(configs)
    )
    return time.perf_counter() - start


def load_aoti(path: Path) -> Callable[..., Any]:
    """A compiled AOTInductor package as a callable taking the program's positional inputs."""
    return torch._inductor.aoti_load_package(str(path))
