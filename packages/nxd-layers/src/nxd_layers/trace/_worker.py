"""The worker: one process per TP rank, started by PyTorch's elastic launcher, serving commands
from the caller over a pipe until told to close.

Protocol: the caller sends ``(command, payload)``; the worker answers ``("ok", result)`` or
``("error", type name, message, traceback)``. Commands:

* ``build``  call ``func()`` (the same seed on every rank), check what it returned, keep the model;
* ``export`` capture one program per bucket (``torch.export``), optionally compile them;
* ``eager``  serve the model itself, uncaptured (for comparisons);
* ``run``    run bucket b on the inputs; rank 0 answers with the outputs and its compute time;
* ``save`` / ``load``  write / read this rank's files;
* ``close``  answer, leave the loop, destroy the process group.

A worker whose caller disappears (its pipe closes) leaves as well.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import nxd_state
from nxd_layers.trace import _artifacts, _neuron, _programs
from nxd_layers.trace._funcref import FuncRef, resolve
from nxd_layers.trace._inputs import decode, encode

__all__ = ["WorkerConfig", "main"]

logger = logging.getLogger("nxd_layers.trace")


@dataclass(kw_only=True)
class WorkerConfig:
    """What every worker is started with."""

    device_type: str
    """``cpu`` (gloo), ``cuda`` (NCCL, one GPU per rank) or ``xla`` (Neuron route)."""
    threads: int
    """Intra-op threads per worker (CPU), and its AOTInductor compile threads."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables."""


@dataclass
class _Rank:
    rank: int
    world: int
    device: torch.device
    model: nn.Module | None = None
    programs: list[Any] = field(default_factory=list)
    runners: list[Callable[..., Any]] = field(default_factory=list)
    aoti_paths: list[Path] = field(default_factory=list)
    aoti_groups: dict[str, list[int]] = field(default_factory=dict)  # names baked into them


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_tp(model: nn.Module, world: int) -> None:
    """Every parallel layer must be sharded over exactly the traced TP degree."""
    for name, module in model.named_modules():
        group = getattr(module, "tensor_parallel_group", None)
        if not isinstance(group, dist.ProcessGroup):
            continue
        size = dist.get_world_size(group)
        if size != world:
            raise ValueError(
                f"layer {name or '<root>'} ({type(module).__name__}) is sharded over {size} "
                f"rank(s), but tp_degree={world}: build the model for tensor_model_parallel_size"
                f"={world} (func() runs after nxd_state.initialize_model_parallel({world}))"
            )


def _build(state: _Rank, payload: dict[str, Any]) -> dict[str, Any]:
    ref: FuncRef = payload["func"]
    torch.manual_seed(payload["seed"])
    nxd_state.model_parallel_manual_seed(payload["seed"])
    result = resolve(ref)()
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise ValueError(
            f"func() must return (model, input_output_alias) with input_output_alias {{}} or "
            f"None (or this rank's state dict), got {type(result).__name__}"
        )
    model, states = result
    if isinstance(states, dict) and not states:
        states = None  # NxD's input_output_alias with no aliases
    if isinstance(states, dict) and not all(isinstance(k, str) for k in states):
        raise ValueError(
            "func() returned a non-empty input_output_alias map (tensor keys): aliasing inputs "
            "to outputs is a Neuron-runtime feature not supported on the portable route; return "
            "(model, {}) or (model, None), or (model, state_dict) with str keys"
        )
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"func() must return (model, state_dict_or_None) with model a torch.nn.Module, got "
            f"{type(model).__name__}"
        )
    if states is not None:
        if not isinstance(states, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in states.items()
        ):
            raise ValueError(
                "func()'s second value must be None or this rank's state dict ({name: tensor}); "
                "NxD's input_output_alias maps are Neuron-only (update buffers in forward "
                "instead: torch.export keeps in-place buffer updates)"
            )
        model.load_state_dict(states, strict=True)
    _check_tp(model, state.world)
    state.model = nxd_state.move_model_to_device(model, state.device).eval()
    return {"parameters": sum(p.numel() for p in model.parameters())}


def _export(state: _Rank, payload: dict[str, Any]) -> dict[str, Any]:
    if state.model is None:
        raise RuntimeError("export before build")
    buckets = [decode(b, state.device) for b in payload["buckets"]]
    if payload.get("neuron") is not None:
        state.programs = _neuron.trace_rank(state.model, buckets, state.rank, **payload["neuron"])
        state.runners = list(state.programs)
        return {"seconds": [], "groups": {}}
    seconds, groups = [], {}
    state.programs, state.runners, state.aoti_paths = [], [], []
    state.aoti_groups = {}
    for index, args in enumerate(buckets):
        start = time.perf_counter()
        program = _programs.export_program(state.model, args)
        seconds.append(time.perf_counter() - start)
        groups.update(_programs.collective_groups(program))
        state.programs.append(program)
        if payload["aot_inductor"]:
            workdir = Path(payload["workdir"])
            path = workdir / _artifacts.program_file(state.rank, index, ".aoti.pt2")
            seconds[-1] += _programs.compile_aoti(program, path, payload["inductor_configs"])
            state.aoti_paths.append(path)
            state.aoti_groups.update(_programs.collective_groups(program))
            state.runners.append(_programs.load_aoti(path))
        else:
            state.runners.append(_programs.runner(program, state.device))
    return {"seconds": seconds, "groups": groups}


def _eager(state: _Rank, payload: dict[str, Any]) -> dict[str, Any]:
    if state.model is None:
        raise RuntimeError("eager before build")
    state.runners = [state.model] * payload["buckets"]
    return {}


def _run(state: _Rank, payload: tuple[int, bytes]) -> tuple[bytes, float] | None:
    bucket, data = payload
    args = decode(data, state.device)
    _sync(state.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = state.runners[bucket](*args)
    _sync(state.device)
    seconds = time.perf_counter() - start
    return (encode(out), seconds) if state.rank == 0 else None


def _save(state: _Rank, payload: dict[str, Any]) -> dict[str, Any]:
    directory = Path(payload["directory"])
    if payload.get("neuron"):
        return _neuron.save_rank(state.programs, directory, state.rank)
    if not state.programs:
        raise RuntimeError("this model holds no captured programs (it was built eager)")
    entry = _artifacts.save_programs(state.programs, directory, state.rank, payload["inline"])
    entry["groups"] = {}
    for program in state.programs:
        entry["groups"].update(_programs.collective_groups(program))
    entry["aoti"] = []
    for index, path in enumerate(state.aoti_paths):
        target = directory / _artifacts.program_file(state.rank, index, ".aoti.pt2")
        if path.resolve() != target.resolve():
            target.write_bytes(path.read_bytes())
        entry["aoti"].append(target.name)
    entry["aoti_groups"] = state.aoti_groups if state.aoti_paths else {}
    return entry


_GROUPS_BY_RANKS: dict[tuple[int, ...], str] = {}  # this process's group names, by ranks


def _group_names(
    rank_lists: list[list[int]], recorded: dict[str, list[int]], create: bool = True
) -> dict[str, str]:
    """Map each recorded group name to this process's group of the same ranks, asking the
    parallel state for a group per rank list first (on every rank, in the manifest's order; it
    creates each once)."""
    world = list(range(dist.get_world_size()))
    world_group = dist.group.WORLD
    assert world_group is not None  # the worker has initialised the default group
    _GROUPS_BY_RANKS.setdefault(tuple(world), world_group.group_name)
    if create:
        state = nxd_state.get_parallel_state()
        for ranks in rank_lists:
            if list(ranks) == world:
                continue
            group = state.group_for(ranks)  # every rank calls it, members or not
            if group is not None:
                _GROUPS_BY_RANKS[tuple(ranks)] = group.group_name
    return {name: _GROUPS_BY_RANKS[tuple(ranks)] for name, ranks in recorded.items()}


def _load(state: _Rank, payload: dict[str, Any]) -> dict[str, Any]:
    directory = Path(payload["directory"])
    entry = payload["entry"]
    if payload.get("neuron"):
        state.programs = _neuron.load_rank(directory, entry)
        state.runners = list(state.programs)
        return {}
    names = _group_names(payload["rank_lists"], entry["groups"])
    programs = []
    for name in entry["programs"]:
        _artifacts.check_archive(directory / name)
        program = torch.export.load(str(directory / name))
        _programs.rename_groups(program, names)
        programs.append(program)
    weights = directory / entry["weights"] if entry.get("weights") else None
    _artifacts.restore_weights(programs, weights, entry.get("aliases", {}))
    state.programs = programs
    state.aoti_paths = [directory / name for name in entry.get("aoti", [])]
    state.aoti_groups = entry.get("aoti_groups", {})
    aoti = entry.get("aoti", []) if payload["use_aoti"] else []
    if aoti:  # the packages call their groups by the names they were compiled with
        _programs.alias_groups(_group_names(payload["rank_lists"], state.aoti_groups, create=False))
    state.runners = []
    for index, program in enumerate(programs):
        if aoti:
            state.runners.append(_programs.load_aoti(directory / aoti[index]))
        else:
            state.runners.append(_programs.runner(program, state.device))
    return {}


_HANDLERS: dict[str, Callable[[_Rank, Any], Any]] = {
    "build": _build,
    "export": _export,
    "eager": _eager,
    "run": _run,
    "save": _save,
    "load": _load,
}


def _own_inductor_cache(rank: int) -> None:
    """Each TP worker compiles into its own Inductor cache (``<cache>/nxd-trace-rank<r>``).

    The ranks' programs are often the same graph, so in one shared cache two workers compile
    the same entry at once and one packages files the other is still writing (AOTInductor
    then fails to load an empty JSON, or a worker crashes). A per-rank folder keeps the cache
    across runs without the race."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    base = os.environ.get("NXD_TRACE_INDUCTOR_CACHE_BASE") or cache_dir()
    os.environ["NXD_TRACE_INDUCTOR_CACHE_BASE"] = base
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"nxd-trace-rank{rank}")


def _pin(config: WorkerConfig, rank: int) -> None:
    """Make this worker run where and how the trace said, whatever the machine shows.

    ``NXD_DEVICE``: the trace's device, so that everything in the worker that asks nxd_state
    (the RNG tracker in ``model_parallel_manual_seed``, ``func()`` itself) agrees with it: a
    CPU trace on a machine with a GPU must not seed or fork the GPU's generator. Threads: the
    intra-op threads, and AOTInductor's compile workers bounded to the same number (Inductor
    fixed its count from the whole machine when the forkserver imported it; one means
    compiling in this process) unless ``TORCHINDUCTOR_COMPILE_THREADS`` says otherwise.
    """
    os.environ["NXD_DEVICE"] = config.device_type
    _own_inductor_cache(rank)
    torch.set_num_threads(config.threads)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = config.threads


@record
def main(conns: list[Connection], config: WorkerConfig) -> None:
    """Entry point of one worker (``RANK`` / ``WORLD_SIZE`` come from the elastic launcher)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    conn = conns[rank]
    for index, other in enumerate(conns):
        if index != rank:
            other.close()  # so a dead worker's pipe reads as closed in the caller
    os.environ.update(config.env)
    _pin(config, rank)
    nxd_state.init_distributed(device_type=config.device_type)
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=world)
    state = _Rank(rank, world, nxd_state.current_device(config.device_type))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError):  # the caller is gone
            break
        if command == "close":
            conn.send(("ok", None))
            break
        try:
            result = _HANDLERS[command](state, payload)
        except BaseException as error:  # report everything; the caller decides
            conn.send(("error", type(error).__name__, str(error), traceback.format_exc()))
        else:
            conn.send(("ok", result))
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
