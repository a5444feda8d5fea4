"""NxD's trace API: ``parallel_model_trace``, ``parallel_model_save``, ``parallel_model_load``.

Every argument is checked here, in the caller, before a worker starts; what a worker raises
(``func`` returning something else than a module, layers built for another TP degree) comes
back as a :class:`~nxd_layers.trace.WorkerError` naming the rank.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from nxd_layers.trace import _artifacts, _neuron
from nxd_layers.trace._funcref import FuncRef, make_ref
from nxd_layers.trace._inputs import encode, normalize_args, signature
from nxd_layers.trace._model import TensorParallelModel
from nxd_layers.trace._options import ExportOptions, neuron_available, parse_compiler_args
from nxd_layers.trace._pool import WorkerPool
from nxd_state import resolve_device_type

__all__ = ["parallel_model_load", "parallel_model_save", "parallel_model_trace"]

logger = logging.getLogger("nxd_layers.trace")


def _bucket_inputs(example_inputs: Any, bucket_config: Any) -> list[tuple[Any, ...]]:
    """The example inputs of every bucket, bucket 0 first."""
    if bucket_config is None:
        return [normalize_args(example_inputs)]
    if isinstance(bucket_config, list | tuple):
        if not bucket_config:
            raise ValueError("bucket_config is an empty list; pass one example input per bucket")
        sets = [] if example_inputs is None else [normalize_args(example_inputs)]
        sets += [normalize_args(b, f"bucket_config[{i}]") for i, b in enumerate(bucket_config)]
    else:  # NxD's call: a torch_neuronx.BucketModelConfig, example_inputs one set per bucket
        if not isinstance(example_inputs, list | tuple) or not example_inputs:
            raise ValueError(
                "with a BucketModelConfig, example_inputs must be a list of one input set per "
                "bucket (NxD's call)"
            )
        sets = [normalize_args(b, f"example_inputs[{i}]") for i, b in enumerate(example_inputs)]
    seen: dict[str, int] = {}
    unique = []
    for index, args in enumerate(sets):
        key = repr(signature(args))
        if key in seen:
            continue  # the same shapes twice: one program serves both
        seen[key] = index
        unique.append(args)
    return unique


def _check_degree(tp_degree: Any, max_parallel_compilations: Any) -> int:
    if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tp_degree must be a positive int, got {tp_degree!r}")
    m = max_parallel_compilations
    if m is None:
        return tp_degree
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"max_parallel_compilations must be None or a positive int, got {m!r}")
    return min(m, tp_degree)


def _check_device(device_type: str, tp_degree: int, neuron: bool) -> None:
    if device_type == "cuda" and torch.cuda.device_count() < tp_degree:
        raise ValueError(
            f"tp_degree={tp_degree} needs {tp_degree} CUDA devices (one per rank), "
            f"{torch.cuda.device_count()} visible; set NXD_DEVICE=cpu to trace on CPU"
        )
    if device_type == "xla" and not neuron:
        raise ValueError(
            "the device is XLA but torch-neuronx is not importable: the portable trace runs on "
            "CPU (gloo) or CUDA (NCCL); set NXD_DEVICE=cpu or install torch-neuronx"
        )


_LAUNCHER_VARS = frozenset(
    [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
    ]
)


def _caller_env() -> dict[str, str]:
    """The caller's environment for the workers (a forkserver child would otherwise see the
    server's), without the launcher's own rank / rendezvous variables."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCHER_VARS and not key.startswith("TORCHELASTIC")
    }


def _cores() -> int:
    """The cores this process may run on (its affinity mask, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - macOS, Windows


def _worker_threads(device_type: str, tp_degree: int) -> int:
    """Intra-op threads of each worker (and its AOTInductor compile threads): the caller's
    ``OMP_NUM_THREADS`` when set (torchrun's convention), else an equal share of its cores;
    1 off the CPU."""
    if device_type != "cpu":
        return 1
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return max(1, _cores() // tp_degree)
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {value!r}")
    return threads


def parallel_model_trace(
    func: Any,
    example_inputs: Any,
    compiler_workdir: str | os.PathLike[str] | None = None,
    compiler_args: Any = None,
    inline_weights_to_neff: bool = True,
    bucket_config: Any = None,
    tp_degree: int = 1,
    max_parallel_compilations: int | None = None,
    *,
    states: Any = None,
    seed: int = 0,
    device_type: str | None = None,
    start_method: str | None = None,
    startup_timeout: float = 600.0,
    call_timeout: float | None = None,
    _eager: bool = False,
) -> TensorParallelModel:
    """Launch ``tp_degree`` workers; each calls ``func()`` -> ``(model, state_dict_or_None)``
    after ``initialize_model_parallel(tp_degree)`` and ``torch.manual_seed(seed)`` (so every rank
    draws the same master weights), and captures its shard for every bucket.

    Portable route (CPU / CUDA): ``torch.export`` per rank, collectives in the graph;
    ``compiler_args``: ``None``, an :class:`ExportOptions` or a dict of its fields
    (``{"aot_inductor": True}``); neuronx-cc flags given as ``compiler_args`` are ignored there,
    with a warning. Neuron route (torch-neuronx importable and an XLA device, or a Neuron-only
    argument: a ``BucketModelConfig``, ``states``): ``torch_neuronx.trace`` per rank, with the
    neuronx-cc flags. ``bucket_config``: a list of example inputs, one program per bucket
    (``example_inputs`` is bucket 0), or NxD's ``BucketModelConfig`` with ``example_inputs`` a
    list of per-bucket inputs; a call is routed by its input shapes. ``max_parallel_compilations``
    bounds the ranks capturing at once. ``inline_weights_to_neff=False`` keeps the weights out of
    the saved programs (``tp_<r>.safetensors``). The second value of ``func()`` is NxD's
    ``input_output_alias`` map: ``None`` or ``{}`` (no aliases, what NxD's examples return; a
    non-empty alias map, keyed by tensors, is refused); nxd also takes this rank's state dict
    there (``{name: tensor}``, loaded strictly). nxd's keywords: ``seed``, ``device_type``
    (``cpu``/``cuda``, default nxd_state's choice), ``start_method``, ``startup_timeout``,
    ``call_timeout``.
    """
    plan = _TracePlan.check(
        func,
        example_inputs,
        compiler_workdir,
        compiler_args,
        inline_weights_to_neff,
        bucket_config,
        tp_degree,
        max_parallel_compilations,
        states,
        device_type,
    )
    start = time.perf_counter()
    pool = plan.start_workers(start_method, startup_timeout)
    plan.build_and_capture(pool, seed, _eager)
    logger.info("traced tp_degree=%d in %.1f s", tp_degree, time.perf_counter() - start)
    return plan.model(pool, _eager, call_timeout)


@dataclass(frozen=True)
class _TracePlan:
    """The checked arguments of one :func:`parallel_model_trace`, before any worker starts."""

    ref: FuncRef
    tp_degree: int
    max_parallel: int
    """Ranks capturing at once."""
    buckets: list[tuple[Any, ...]]
    """The example inputs of every bucket, bucket 0 first."""
    options: ExportOptions
    inline_weights_to_neff: bool
    states: Any
    device: str
    neuron: bool
    """The Neuron route (``torch_neuronx.trace``), else the portable one (``torch.export``)."""
    neuron_flags: Any
    """The neuronx-cc flags (``None`` on the portable route)."""
    workdir: Path | None
    own_workdir: tempfile.TemporaryDirectory[str] | None
    """The temporary folder nxd owns for AOTInductor (kept alive with the model)."""

    @classmethod
    def check(
        cls,
        func: Any,
        example_inputs: Any,
        compiler_workdir: str | os.PathLike[str] | None,
        compiler_args: Any,
        inline_weights_to_neff: Any,
        bucket_config: Any,
        tp_degree: Any,
        max_parallel_compilations: Any,
        states: Any,
        device_type: str | None,
    ) -> _TracePlan:
        """Check every argument of :func:`parallel_model_trace` and pick its route."""
        ref = make_ref(func)
        max_parallel = _check_degree(tp_degree, max_parallel_compilations)
        buckets = _bucket_inputs(example_inputs, bucket_config)
        options, flags = parse_compiler_args(compiler_args)
        if not isinstance(inline_weights_to_neff, bool):
            raise ValueError(
                f"inline_weights_to_neff must be a bool, got {inline_weights_to_neff!r}"
            )
        device = resolve_device_type(device_type)
        neuron, flags = _route(device, options, flags, bucket_config, states)
        _check_device(device, tp_degree, neuron)
        workdir, own_workdir = _workdir(compiler_workdir, options)
        return cls(
            ref=ref,
            tp_degree=tp_degree,
            max_parallel=max_parallel,
            buckets=buckets,
            options=options,
            inline_weights_to_neff=inline_weights_to_neff,
            states=states,
            device=device,
            neuron=neuron,
            neuron_flags=flags,
            workdir=workdir,
            own_workdir=own_workdir,
        )

    def start_workers(self, start_method: str | None, startup_timeout: float) -> WorkerPool:
        """The ``tp_degree`` workers, logging to ``workdir/logs`` when there is a workdir."""
        log_dir = str(self.workdir / "logs") if self.workdir is not None else None
        return _start_pool(self.tp_degree, self.device, start_method, startup_timeout, log_dir)

    def build_and_capture(self, pool: WorkerPool, seed: int, eager: bool) -> None:
        """Every worker builds the model (``func()`` after seeding), then captures it, or serves
        it uncaptured when ``eager``; the workers are closed if a step fails."""
        try:
            pool.request("build", {"func": self.ref, "seed": seed})
            if eager:
                pool.request("eager", {"buckets": len(self.buckets)})
            else:
                self.capture(pool)
        except BaseException:
            pool.close()
            raise

    def capture(self, pool: WorkerPool) -> None:
        """Every rank captures its programs, at most ``max_parallel`` ranks at once."""
        payload = self.capture_payload()
        for first in range(0, self.tp_degree, self.max_parallel):
            ranks = range(first, min(self.tp_degree, first + self.max_parallel))
            replies = pool.request("export", payload, ranks=ranks)
            for rank, reply in sorted(replies.items()):
                logger.info(
                    "rank %d: %d bucket(s) captured in %s s",
                    rank,
                    len(self.buckets),
                    reply["seconds"],
                )

    def capture_payload(self) -> dict[str, Any]:
        """What every worker's ``export`` command captures from."""
        workdir = str(self.workdir) if self.workdir is not None else None
        payload: dict[str, Any] = {
            "buckets": [encode(args) for args in self.buckets],
            "workdir": workdir,
            "neuron": None,
            **self.options.as_dict(),
        }
        if self.neuron:
            payload["neuron"] = {
                "compiler_workdir": workdir,
                "compiler_args": self.neuron_flags,
                "inline_weights_to_neff": self.inline_weights_to_neff,
                "states": self.states,
            }
        return payload

    def model(
        self, pool: WorkerPool, eager: bool, call_timeout: float | None
    ) -> TensorParallelModel:
        """The traced model its workers serve; a call is routed by its input shapes."""
        signatures = [signature(args) for args in self.buckets]
        return TensorParallelModel(pool, signatures, self.info(eager), call_timeout=call_timeout)

    def info(self, eager: bool) -> dict[str, Any]:
        """The traced model's description (``TensorParallelModel.info``)."""
        return {
            "backend": "neuron" if self.neuron else "export",
            "device_type": self.device,
            "inline_weights_to_neff": self.inline_weights_to_neff,
            "compiler": self.options.as_dict(),
            "eager": eager,
            "workdir": self.own_workdir,  # kept alive with the model (AOTInductor packages)
        }


def _start_pool(
    tp_degree: int,
    device: str,
    start_method: str | None,
    startup_timeout: float,
    log_dir: str | None = None,
) -> WorkerPool:
    """Start ``tp_degree`` workers on ``device`` with the caller's environment."""
    return WorkerPool(
        tp_degree,
        device_type=device,
        threads=_worker_threads(device, tp_degree),
        start_method=start_method,
        startup_timeout=startup_timeout,
        env=_caller_env(),
        log_dir=log_dir,
    )


def _route(
    device: str, options: ExportOptions, neuron_flags: Any, bucket_config: Any, states: Any
) -> tuple[bool, Any]:
    """Neuron route or portable route, and the neuronx-cc flags that route uses (None on the
    portable one, with a warning when some were given)."""
    neuron_reasons = [
        reason
        for reason, present in (
            ("a BucketModelConfig", not isinstance(bucket_config, list | tuple | type(None))),
            ("states=", states is not None),
        )
        if present
    ]
    neuron = bool(neuron_reasons) or (device == "xla" and neuron_available())
    if neuron_flags is not None and not neuron:
        # neuronx-cc flags tune the Neuron compiler; the portable route compiles nothing
        # with them (its numerics are the model's own), so NxD's scripts run unchanged.
        logger.warning(
            "compiler_args %s are neuronx-cc flags: ignored on the portable route "
            "(torch.export on %s; torch-neuronx is used on an XLA device where installed)",
            neuron_flags,
            device,
        )
        neuron_flags = None
    if neuron:
        _neuron.require(" and ".join(neuron_reasons) or "tracing on an XLA device")
        if options.aot_inductor:
            raise ValueError("aot_inductor is a portable-route option; the Neuron route compiles")
    if options.aot_inductor and importlib.util.find_spec("setuptools") is None:
        raise ImportError(
            f"compiler_args aot_inductor=True: AOTInductor needs setuptools with torch "
            f"{torch.__version__} (pip install setuptools) and a C++ compiler"
        )
    return neuron, neuron_flags


def _workdir(
    compiler_workdir: str | os.PathLike[str] | None, options: ExportOptions
) -> tuple[Path | None, tempfile.TemporaryDirectory[str] | None]:
    """The folder the workers write to (created), and the temporary one nxd owns when
    AOTInductor needs a folder and none was given (it lives as long as the model)."""
    workdir = Path(compiler_workdir) if compiler_workdir is not None else None
    own_workdir = None
    if options.aot_inductor and workdir is None:
        own_workdir = tempfile.TemporaryDirectory(prefix="nxd-trace-aoti-")
        workdir = Path(own_workdir.name)
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    return workdir, own_workdir


def parallel_model_save(model: TensorParallelModel, save_dir: str | os.PathLike[str]) -> None:
    """Write ``model`` to ``save_dir``: per rank ``tp_<rank>.pt2`` (one file per extra
    bucket), the weights in ``tp_<rank>.safetensors`` unless inlined, and ``manifest.json``."""
    if not isinstance(model, TensorParallelModel):
        raise ValueError(
            f"parallel_model_save takes the TensorParallelModel that parallel_model_trace or "
            f"parallel_model_load returned, got {type(model).__name__}"
        )
    if model.info.get("eager"):
        raise ValueError("this model was built eager (nothing captured): trace it to save it")
    directory = Path(save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    neuron = model.info["backend"] == "neuron"
    replies = model._pool.request(
        "save",
        {
            "directory": str(directory),
            "inline": model.info["inline_weights_to_neff"],
            "neuron": neuron,
        },
    )
    _artifacts.write_manifest(
        directory,
        {
            "tp_degree": model.tp_degree,
            "backend": model.info["backend"],
            "device_type": model.info["device_type"],
            "inline_weights_to_neff": model.info["inline_weights_to_neff"],
            "compiler": model.info["compiler"],
            "buckets": model.buckets,
            "ranks": [replies[rank] for rank in range(model.tp_degree)],
            "torch_version": torch.__version__,
            "nxd_layers_version": version("nxd-layers"),
        },
    )
    logger.info("saved tp_degree=%d to %s", model.tp_degree, directory)


def parallel_model_load(
    load_dir: str | os.PathLike[str],
    *,
    start_method: str | None = None,
    startup_timeout: float = 600.0,
    call_timeout: float | None = None,
    use_aot_inductor: bool = True,
) -> TensorParallelModel:
    """The :class:`TensorParallelModel` saved in ``load_dir``, rebuilt from its files alone (no
    model code is imported). Every rank's files are checked before a worker starts.
    ``use_aot_inductor=False`` runs the exported programs even where compiled packages were
    saved (they are also skipped, with a warning, under another torch version)."""
    directory = Path(load_dir)
    manifest = _artifacts.read_manifest(directory)
    tp_degree, device = manifest["tp_degree"], manifest["device_type"]
    neuron = manifest["backend"] == "neuron"
    use_aoti = _check_saved(directory, manifest, use_aot_inductor)
    rank_lists = _captured_rank_lists(manifest)
    pool = _start_pool(tp_degree, device, start_method, startup_timeout)
    try:
        pool.request(
            "load",
            per_rank=[
                {
                    "directory": str(directory),
                    "entry": entry,
                    "rank_lists": [list(r) for r in rank_lists],
                    "use_aoti": use_aoti,
                    "neuron": neuron,
                }
                for entry in manifest["ranks"]
            ],
        )
    except BaseException:
        pool.close()
        raise
    info = {
        "backend": manifest["backend"],
        "device_type": device,
        "inline_weights_to_neff": manifest["inline_weights_to_neff"],
        "compiler": {**ExportOptions().as_dict(), **manifest.get("compiler", {})},
        "eager": False,
        "aot_inductor_loaded": use_aoti,
    }
    return TensorParallelModel(pool, manifest["buckets"], info, call_timeout=call_timeout)


def _check_saved(directory: Path, manifest: dict[str, Any], use_aot_inductor: bool) -> bool:
    """Check every rank's files, and the device, before a worker starts; whether the workers
    run the saved AOTInductor packages (not under another torch version than theirs)."""
    tp_degree, device = manifest["tp_degree"], manifest["device_type"]
    neuron = manifest["backend"] == "neuron"
    if neuron:
        _neuron.require("loading a Neuron-traced model")
    else:
        for entry in manifest["ranks"]:
            for name in entry["programs"]:
                _artifacts.check_archive(directory / name)
    _check_device(device, tp_degree, neuron)
    use_aoti = use_aot_inductor and any(entry.get("aoti") for entry in manifest["ranks"])
    if use_aoti and manifest["torch_version"] != torch.__version__:
        logger.warning(
            "%s: AOTInductor packages were built with torch %s, this is %s: running the "
            "exported programs instead",
            directory,
            manifest["torch_version"],
            torch.__version__,
        )
        return False
    return use_aoti


def _captured_rank_lists(manifest: dict[str, Any]) -> list[tuple[int, ...]]:
    """The rank list of every process group the saved programs communicate on (each worker
    asks its parallel state for these groups, in this order)."""
    return sorted(
        {
            tuple(ranks)
            for entry in manifest["ranks"]
            for groups in (entry["groups"], entry.get("aoti_groups", {}))
            for ranks in groups.values()
        }
    )
