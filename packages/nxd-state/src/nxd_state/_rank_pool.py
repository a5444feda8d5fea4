"""The warm rank pool both harnesses start ranks from: one forkserver, its preloaded imports,
the environment every rank gets, and how a rank finds the function it runs (by file).

:mod:`nxd_state.testing` (supervised ranks) and :mod:`nxd_state._launch` (ranks left alone, as
a job launcher leaves them) share it; neither imports the other's internals.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import multiprocessing.context
import os
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# Imported once by the forkserver so ranks start warm; missing ones are skipped.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "nxd_state",
    "nxd_state.testing",
    "nxd_layers",
    "nxd_pipeline",
    "nxd_optim",
    "nxd_lora",
    "nxd_ckpt",
    "nxd_trainer",
    "nxd_lightning",
    *filter(None, os.environ.get("NXD_TEST_PRELOAD", "").split(",")),
]
# The concrete contexts (BaseContext's stub has no Process): forkserver, spawn on Windows.
_context: (
    multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext | None
) = None


def add_preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` once, so ranks do not each import them.

    Call it before the first :func:`run_distributed` (a package's ``conftest.py`` is the place):
    the forkserver starts on first use and its imports are fixed from then on.
    """
    for module in modules:
        if module not in _PRELOAD:
            _PRELOAD.append(module)
    if _context is not None:
        _context.set_forkserver_preload(_PRELOAD)  # effective only if not started yet


def cpu_test_environment() -> dict[str, str]:
    """What a CPU test pins, in its ranks and in the test process itself: the CPU device
    (``NXD_DEVICE=cpu``: a visible GPU or ``PJRT_DEVICE`` must not move it) and one OpenMP
    thread for every process it starts. A package's ``conftest.py`` applies it to its tests::

        @pytest.fixture(autouse=True)
        def _cpu_tests(monkeypatch):
            for key, value in cpu_test_environment().items():
                monkeypatch.setenv(key, value)
    """
    return {"NXD_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}


def rank_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every rank of :func:`run_distributed` and :func:`launch_ranks` gets on
    top of the forkserver's: :func:`cpu_test_environment` (the CPU device, one OpenMP thread),
    gloo on the loopback interface (Linux), then ``env`` (a test that runs its ranks elsewhere
    says so there, e.g. ``env={"NXD_DEVICE": "cuda"}``)."""
    pinned = cpu_test_environment()
    if sys.platform.startswith("linux"):
        pinned["GLOO_SOCKET_IFNAME"] = "lo"
    pinned.update(env or {})
    return pinned


def _get_context() -> (
    multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
):
    global _context
    if _context is None:
        if sys.platform == "win32":  # pragma: no cover - no forkserver on Windows
            _context = multiprocessing.get_context("spawn")
        else:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(_PRELOAD)
    return _context


def _import_file(name: str, path: str | os.PathLike[str]) -> types.ModuleType:
    """Import the file ``path`` as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py path always has one
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _load_function(path: str, module: str, qualname: str) -> Callable[..., Any]:
    loaded = sys.modules.get(module)
    loaded_file = getattr(loaded, "__file__", None)
    if loaded is None or loaded_file is None or str(Path(loaded_file).resolve()) != path:
        loaded = _import_file(f"_nxd_rank_{module}", path)
    target: Any = loaded
    for part in qualname.split("."):
        target = getattr(target, part)
    return target
