"""Launch ranks the way a job launcher does, without the harness's supervision.

:func:`nxd_state.testing.run_distributed` stops every rank as soon as one fails, which is right
for tests of results but hides what a real job does when a rank dies. :func:`launch_ranks`
starts the same warm ranks (forkserver, gloo through :func:`nxd_state.init_distributed`, so
nxd's collective timeout and rank records apply) and leaves them alone: a rank that raises
prints its traceback and exits with code 1, as a script under ``torchrun`` does, and its peers
must find out by themselves. The caller waits, reads each rank's exit code and log, and kills
what is left (which a test counts as a failure to exit).
"""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LaunchedRanks", "launch_ranks", "process_alive"]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"


def _unsupervised_main(
    rank: int,
    world_size: int,
    rendezvous: str,
    function: tuple[str, str, str],
    payload: bytes,
    log_path: str,
    env: dict[str, str],
) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch

    import nxd_state
    from nxd_state._rank_pool import _load_function

    torch.set_num_threads(1)
    from nxd_state import health

    code = 0
    try:
        nxd_state.init_distributed(
            device_type="cpu",
            init_method=f"file://{rendezvous}?rank={rank}&world_size={world_size}",
        )
        fn = _load_function(*function)
        args, kwargs = pickle.loads(payload)
        fn(*args, **kwargs)
    except SystemExit as exit_:  # as the interpreter does: the code, no traceback
        code = exit_.code if isinstance(exit_.code, int) else 1
        health.record_end(f"exited (sys.exit({exit_.code!r}))")
    except BaseException:  # as an uncaught exception would: recorded, printed, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    health.record_end("exited (end of script)")  # no-op when already recorded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class LaunchedRanks:
    """Ranks started by :func:`launch_ranks`: their processes, logs and exit codes."""

    procs: list[Any]
    logs: list[Path]
    started: float
    exit_times: dict[int, float] = field(default_factory=dict)
    workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def wait(self, timeout: float, ranks: list[int] | None = None) -> list[int | None]:
        """Wait up to ``timeout`` seconds for ``ranks`` (default: all) to exit; every rank's
        exit code (None: still running). Exit times (seconds since launch) go to
        ``exit_times``."""
        deadline = time.monotonic() + timeout
        awaited = range(len(self.procs)) if ranks is None else ranks
        while True:
            # One snapshot: a rank exiting between two reads of exitcode would be returned as
            # exited with no exit time.
            codes = [proc.exitcode for proc in self.procs]
            now = time.monotonic() - self.started
            for rank, code in enumerate(codes):
                if code is not None and rank not in self.exit_times:
                    self.exit_times[rank] = now
            if all(codes[r] is not None for r in awaited) or time.monotonic() >= deadline:
                return codes
            time.sleep(0.05)

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text() if self.logs[rank].exists() else ""

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[rank].pid, sig)

    def close(self) -> list[int]:
        """Kill every rank still running; the ranks that had to be killed."""
        leftover = [rank for rank, proc in enumerate(self.procs) if proc.is_alive()]
        for rank in leftover:
            self.procs[rank].kill()
        for proc in self.procs:
            proc.join(timeout=10)
        if self.workdir is not None:
            self.workdir.cleanup()
        return leftover

    def __enter__(self) -> LaunchedRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    log_dir: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> LaunchedRanks:
    """Start ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and return at once.

    Each rank's stdout and stderr go to ``log_dir/rank-<r>.log``. Every rank runs under
    :func:`nxd_state.testing.rank_environment` (the CPU device, one thread), ``env`` added last
    (e.g. ``NXD_COLLECTIVE_TIMEOUT_S``). ``fn`` must be a module-level function.
    """
    from nxd_state._rank_pool import _get_context, rank_environment

    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise ValueError(f"launch_ranks needs a module-level function, got {fn.__qualname__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    path = str(Path(inspect.getfile(fn)).resolve())
    function = (path, fn.__module__, fn.__qualname__)
    payload = pickle.dumps((args, kwargs))
    rank_env = rank_environment(env)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    logs = [Path(log_dir) / f"rank-{rank}.log" for rank in range(world_size)]
    workdir = tempfile.TemporaryDirectory(prefix="nxd-launch-")
    rendezvous = os.path.join(workdir.name, "rendezvous")
    context = _get_context()
    procs = []
    started = time.monotonic()
    for rank in range(world_size):
        proc = context.Process(
            target=_unsupervised_main,
            args=(rank, world_size, rendezvous, function, payload, str(logs[rank]), rank_env),
            name=f"nxd-launched-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return LaunchedRanks(procs=procs, logs=logs, started=started, workdir=workdir)
