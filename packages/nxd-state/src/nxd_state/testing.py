"""Run a function on N gloo ranks and get every rank's result back: the multi-rank test harness.

    results = run_distributed(check_all_reduce, world_size=4, size=8)

``fn`` must be a module-level function (it is looked up by file and name in each rank). Each
rank is a fresh process forked from a *forkserver* that imported torch and the nxd packages
once, so starting a rank costs a fork and a gloo rendezvous, not a Python + torch start-up.

What a rank's results must not depend on is pinned (:func:`rank_environment`), the same on a
2-core CI machine and a 16-core one with a GPU:

* the device: ``NXD_DEVICE=cpu`` in every rank unless the test's ``env`` names another, so
  nothing in a CPU test picks CUDA (or XLA, under ``PJRT_DEVICE``) because one is visible;
* the threads: one intra-op thread per rank (``torch.set_num_threads(1)``), and
  ``OMP_NUM_THREADS=1`` for any process a rank starts, whatever the caller's thread count or
  the machine's cores (2-core CI runs 8 ranks at once; a kernel's blocking, hence its
  rounding, may follow the thread count).

Failure behaviour:

* a rank that raises: the others are stopped and the original exception is re-raised in the
  caller, with the rank number in a note and the rank's traceback as its ``__cause__``;
* a rank that dies without reporting (segfault, ``os._exit``): :class:`RankDiedError`;
* ``timeout`` seconds without every rank finishing: each rank's Python stack is dumped
  (faulthandler) and raised in :class:`DistributedTimeoutError` instead of hanging.

:func:`launch_ranks` starts the same ranks without this supervision (a failing rank exits
non-zero and its peers must notice by themselves), for tests of what a job does when a rank
dies.

Results cross the process boundary with pickle: return plain values or CPU tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from nxd_state._launch import LaunchedRanks, launch_ranks, process_alive
from nxd_state._rank_pool import (
    _get_context,
    _import_file,
    _load_function,
    add_preload,
    cpu_test_environment,
    rank_environment,
)

__all__ = [
    "SLOW_MARKER",
    "DistributedTimeoutError",
    "LaunchedRanks",
    "RankDiedError",
    "RemoteTraceback",
    "add_preload",
    "cpu_test_environment",
    "launch_ranks",
    "load_sibling",
    "pin_cpu_test",
    "process_alive",
    "rank_environment",
    "run_distributed",
    "run_named_checks",
    "skip_slow_unless_selected",
]

T = TypeVar("T")

_DEFAULT_TIMEOUT = float(os.environ.get("NXD_TEST_TIMEOUT", "180"))
# After the first failure, how long the other ranks get to report theirs.
_FAILURE_GRACE_S = 1.0


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in another rank."""

    def __str__(self) -> str:
        return str(self.args[0])


class RankDiedError(RuntimeError):
    """A rank's process ended without reporting a result or an exception."""


class DistributedTimeoutError(TimeoutError):
    """The ranks did not all finish in time; the message holds every live rank's stack."""


SLOW_MARKER = "slow: heavier variants (more ranks, steps or kills); selected with -m slow"


def skip_slow_unless_selected(config: Any, items: list[Any]) -> None:
    """A suite's ``pytest_collection_modifyitems`` for the ``slow`` marker: ``slow`` tests are
    skipped, with the reason, unless ``-m`` names the marker (``-m slow``, ``-m "slow or
    not slow"``). Register :data:`SLOW_MARKER` in ``pytest_configure``."""
    if "slow" in (config.getoption("-m") or ""):
        return
    import pytest

    skip = pytest.mark.skip(reason="slow variant: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def run_named_checks(
    checks: Mapping[str, Callable[[], None]], *, seed: int = 0, context: str = ""
) -> list[str]:
    """Inside a rank: run every check in order, reseeding torch with ``seed + i`` before check
    ``i`` so every rank draws the same inputs and weights.

    Many checks share one spawn this way. The first failure is raised as an AssertionError
    naming the check (and ``context``, e.g. "tp=2"), which stops every rank instead of leaving
    its peers waiting in a collective. Returns the names of the checks that ran.
    """
    import torch

    for i, (name, check) in enumerate(checks.items()):
        torch.manual_seed(seed + i)
        try:
            check()
        except Exception as error:
            where = f" at {context}" if context else ""
            raise AssertionError(f"check {name!r} failed{where}: {error}") from error
    return list(checks)


def load_sibling(test_file: str | os.PathLike[str], name: str) -> types.ModuleType:
    """The module ``<name>.py`` beside ``test_file``, imported by path once per process.

    Shared test helpers (``_recipe.py``, ``_models.py``) are not importable by name: pytest's
    importlib mode keeps test folders off ``sys.path``. Each file is registered once under a
    name made from its path, so every test file that loads it shares one module, and functions
    from it can be given to :func:`run_distributed` (ranks find them by file)::

        R = load_sibling(__file__, "_recipe")
    """
    path = Path(test_file).resolve().with_name(f"{name}.py")
    if not path.is_file():
        raise FileNotFoundError(f"load_sibling: no {path.name} beside {test_file}")
    key = "_nxd_sibling_" + re.sub(r"\W", "_", str(path.with_suffix("")))
    return sys.modules[key] if key in sys.modules else _import_file(key, path)


def pin_cpu_test(node: Any, setenv: Callable[[str, str], None]) -> None:
    """Apply :func:`cpu_test_environment` to a test unless it is marked ``xla``: the body of
    the autouse fixture every package's ``conftest.py`` holds::

        @pytest.fixture(autouse=True)
        def _cpu_tests(request, monkeypatch):
            pin_cpu_test(request.node, monkeypatch.setenv)
    """
    if node.get_closest_marker("xla") is None:
        for key, value in cpu_test_environment().items():
            setenv(key, value)


def _rank_main(
    rank: int,
    world_size: int,
    rendezvous: str,
    function: tuple[str, str, str],
    payload: bytes,
    conn: multiprocessing.connection.Connection,
    stack_path: str,
    env: dict[str, str],
    timeout_s: float,
) -> None:
    stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world_size,
            # Outlive the parent's deadline, so a hang is reported with stacks, not a gloo error.
            timeout=datetime.timedelta(seconds=timeout_s + 30),
        )
        fn = _load_function(*function)
        args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
        message = pickle.dumps(("ok", result))
        dist.barrier()  # every rank done: exiting now cannot cut a peer's transfer short
    except BaseException as error:  # report everything, KeyboardInterrupt included
        text = traceback.format_exc()
        try:
            message = pickle.dumps(("error", error, text))
        except Exception:  # unpicklable exception: send its text only
            message = pickle.dumps(("error", None, text))
    conn.send_bytes(message)
    conn.close()
    # Leave without tearing down the process group: peers may be mid-collective, and the
    # parent reaps every rank once all have reported.
    stack_file.close()
    os._exit(0)


def _raise_rank_error(
    rank: int, world_size: int, error: BaseException | None, text: str
) -> NoReturn:
    cause = RemoteTraceback(f"\n--- rank {rank} of {world_size} ---\n{text}")
    if error is None:
        raise RuntimeError(f"rank {rank} of {world_size} failed") from cause
    if hasattr(error, "add_note"):
        error.add_note(f"(raised on rank {rank} of {world_size})")
    raise error from cause


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    Each rank runs under :func:`rank_environment` (``env`` added last) with one intra-op
    thread."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise ValueError(
            f"run_distributed needs a module-level function, got {fn.__qualname__}: ranks look "
            f"the function up by module and name"
        )
    timeout = _DEFAULT_TIMEOUT if timeout is None else timeout
    path = str(Path(inspect.getfile(fn)).resolve())
    function = (path, fn.__module__, fn.__qualname__)
    payload = pickle.dumps((args, kwargs))
    rank_env = rank_environment(env)
    context = _get_context()

    with tempfile.TemporaryDirectory(prefix="nxd-ranks-") as workdir:
        rendezvous = os.path.join(workdir, "rendezvous")
        stacks = [os.path.join(workdir, f"stack-{rank}.txt") for rank in range(world_size)]
        procs, conns = [], {}
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            proc = context.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    rendezvous,
                    function,
                    payload,
                    sender,
                    stacks[rank],
                    rank_env,
                    timeout,
                ),
                name=f"nxd-rank-{rank}",
                daemon=True,
            )
            proc.start()
            sender.close()
            procs.append(proc)
            conns[receiver] = rank
        try:
            return _collect(procs, conns, stacks, world_size, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)


def _collect(
    procs: list[Any],
    conns: dict[multiprocessing.connection.Connection, int],
    stacks: list[str],
    world_size: int,
    timeout: float,
) -> list[Any]:
    """Gather every rank's report; on the first failure, give the others a moment to report too.

    A rank that dies makes its peers fail with "connection closed" shortly after, so the dead
    rank is the root cause and is reported first; otherwise the earliest exception wins.
    """
    results: dict[int, Any] = {}
    errors: list[tuple[int, BaseException | None, str]] = []
    died: list[int] = []
    pending = dict(conns)
    deadline = time.monotonic() + timeout
    grace_until: float | None = None
    while pending:
        now = time.monotonic()
        if grace_until is not None and now >= grace_until:
            break
        if now >= deadline:
            _raise_timeout(procs, pending, stacks, timeout)
        sentinels = {procs[rank].sentinel: rank for rank in pending.values()}
        limit = min(deadline, grace_until) if grace_until is not None else deadline
        ready = multiprocessing.connection.wait([*pending, *sentinels], timeout=limit - now)
        for conn in [item for item in ready if item in pending]:
            rank = pending.pop(conn)
            try:
                status, *body = pickle.loads(conn.recv_bytes())
            except EOFError:
                died.append(rank)
                continue
            if status == "ok":
                results[rank] = body[0]
            else:
                errors.append((rank, body[0], body[1]))
        for item in ready:
            if not isinstance(item, int) or item not in sentinels:
                continue  # a connection, read above
            rank = sentinels[item]
            owner = next((c for c, r in pending.items() if r == rank), None)
            if owner is None or owner.poll():
                continue  # reported already, or its report waits to be read on the next pass
            pending.pop(owner)
            died.append(rank)
        if (errors or died) and grace_until is None:
            grace_until = time.monotonic() + _FAILURE_GRACE_S
    if died or errors:
        _raise_root_cause(procs, died, errors, world_size)
    return [results[rank] for rank in range(world_size)]


def _raise_root_cause(
    procs: list[Any],
    died: list[int],
    errors: list[tuple[int, BaseException | None, str]],
    world_size: int,
) -> NoReturn:
    """Raise for the first rank that died without a report (its peers' errors listed after
    it), else re-raise the first rank's exception."""
    if died:
        rank = died[0]
        procs[rank].join(timeout=1)
        others = "".join(
            f"\n  then rank {r} raised: {text.strip().splitlines()[-1]}" for r, _, text in errors
        )
        raise RankDiedError(
            f"rank {rank} of {world_size} exited with code {procs[rank].exitcode} "
            f"without reporting a result{others}"
        )
    _raise_rank_error(errors[0][0], world_size, errors[0][1], errors[0][2])


def _raise_timeout(
    procs: list[Any],
    pending: dict[multiprocessing.connection.Connection, int],
    stacks: list[str],
    timeout: float,
) -> None:
    waiting = sorted(pending.values())
    for rank in waiting:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)
    dumps = []
    for rank in waiting:
        text = Path(stacks[rank]).read_text() if os.path.exists(stacks[rank]) else ""
        dumps.append(f"--- rank {rank} ---\n{text.strip() or '(no stack captured)'}")
    raise DistributedTimeoutError(
        f"ranks {waiting} did not finish within {timeout:.0f}s; their stacks:\n" + "\n".join(dumps)
    )
