"""The TP workers of a traced model, kept alive between calls.

Workers are started by PyTorch's elastic launcher (``torch.distributed.launcher.api``, what
``torchrun`` runs): its agent runs in a daemon thread of the caller for as long as the model
lives (it rendezvouses the workers, sets ``RANK``/``WORLD_SIZE``/``MASTER_*``, watches them and
stops all of them when one fails, with the failure's root cause). The caller talks to each
worker over its own pipe; a worker that dies closes its pipe, so the caller sees it at once and
raises :class:`WorkerDiedError` (with the agent's report when it arrives in time) instead of
waiting. Any error makes the pool unusable: the other ranks may be waiting in a collective for
the failed one, so every worker is ended (by the process ids the workers reported).

``start_method`` defaults to ``forkserver`` (workers fork from a server that imported torch
once) where available, else ``spawn``; ``func`` and a script's ``__main__`` are found in the
workers by name (the usual ``if __name__ == "__main__":`` guard applies).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import time
import uuid
import weakref
from multiprocessing.connection import Connection
from typing import Any, cast

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from nxd_layers.trace import _worker

__all__ = ["WorkerDiedError", "WorkerError", "WorkerPool"]

logger = logging.getLogger("nxd_layers.trace")
_POLL_S = 0.05
_AGENT_REPORT_WAIT_S = 10.0
# What the forkserver imports once for all workers (torch.export pulls in dynamo: seconds).
_PRELOAD = ["torch", "torch.export", "torch._dynamo", "nxd_layers.trace._worker"]
_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


class _DropThreadWarning(logging.Filter):
    """The agent runs in a thread on purpose, so it cannot install signal handlers; orphaned
    workers are not a risk here (a worker leaves when its pipe to the caller closes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "running on a child thread" not in record.getMessage()


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropThreadWarning())


class WorkerError(RuntimeError):
    """A TP worker raised; ``rank`` and the worker's traceback (``remote_traceback``) attached."""

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class WorkerDiedError(WorkerError):
    """A TP worker process ended without answering (killed, crashed, or exited)."""


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _launch_config(tp_degree: int, method: str, log_dir: str) -> LaunchConfig:
    """The elastic launcher's configuration: ``tp_degree`` processes on this node, a fresh
    rendezvous on a free local port, no restarts, logs in ``log_dir``."""
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=tp_degree,
        run_id=f"nxd-trace-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=method,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


class WorkerPool:
    """``tp_degree`` worker processes (one per TP rank) serving commands until :meth:`close`."""

    def __init__(
        self,
        tp_degree: int,
        *,
        device_type: str,
        threads: int,
        start_method: str | None = None,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.tp_degree = tp_degree
        self._closed = False
        self._broken: str | None = None
        self._launch_error: BaseException | None = None
        self._pids: list[int] = []
        self._lock = threading.Lock()  # one request at a time: replies are matched by order
        self._tmp = tempfile.TemporaryDirectory(prefix="nxd-trace-") if log_dir is None else None
        method = start_method or _default_start_method()
        context = multiprocessing.get_context(method)
        if method == "forkserver":  # effective only if the server is not running yet
            context.set_forkserver_preload(_PRELOAD)
        pipes = [context.Pipe(duplex=True) for _ in range(tp_degree)]
        self._conns = [ours for ours, _ in pipes]
        theirs = [child for _, child in pipes]
        config = _launch_config(tp_degree, method, log_dir or self._tmp.name)  # type: ignore[union-attr]
        worker_config = _worker.WorkerConfig(
            device_type=device_type, threads=threads, env=env or {}
        )
        self._thread = threading.Thread(
            target=self._launch,
            args=(config, theirs, worker_config),
            name="nxd-trace-agent",
            daemon=True,
        )
        start = time.perf_counter()
        self._thread.start()
        try:
            replies = self._gather(range(tp_degree), startup_timeout, "start")
            self._pids = [replies[rank] for rank in range(tp_degree)]
        except BaseException:
            self.kill()
            raise
        finally:
            for conn in theirs:  # the workers hold their ends now
                conn.close()
        _POOLS.add(self)
        logger.info(
            "started %d TP workers (%s, pids %s) in %.1f s",
            tp_degree,
            method,
            self._pids,
            time.perf_counter() - start,
        )

    # Launch ------------------------------------------------------------------------------
    def _launch(self, config: LaunchConfig, conns: list[Any], worker_config: Any) -> None:
        try:
            elastic_launch(config, _worker.main)(conns, worker_config)
        except BaseException as error:  # ChildFailedError, SignalException, rendezvous errors
            self._launch_error = error

    @property
    def alive(self) -> bool:
        return not self._closed and self._broken is None and self._thread.is_alive()

    # Requests ----------------------------------------------------------------------------
    def request(
        self,
        command: str,
        payload: Any = None,
        *,
        ranks: list[int] | range | None = None,
        per_rank: list[Any] | None = None,
        timeout: float | None = None,
    ) -> dict[int, Any]:
        """Send ``(command, payload)`` (or ``per_rank[r]``) to ``ranks`` (default: all) and
        return their results by rank; raise on the first worker error, death or timeout."""
        if self._closed:
            raise RuntimeError("this TensorParallelModel is closed")
        if self._broken is not None:
            raise RuntimeError(f"the TP workers are gone after an earlier failure: {self._broken}")
        targets = list(range(self.tp_degree) if ranks is None else ranks)
        with self._lock:
            for rank in targets:
                message = (command, payload if per_rank is None else per_rank[rank])
                try:
                    self._conns[rank].send(message)
                except (BrokenPipeError, OSError):
                    self._fail_died(rank)
            return self._gather(targets, timeout, command)

    def _gather(self, ranks: Any, timeout: float | None, command: str) -> dict[int, Any]:
        pending = {self._conns[rank]: rank for rank in ranks}
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            # wait returns the ready ones among the objects given: our Connections
            ready = cast(
                "list[Connection]", multiprocessing.connection.wait(list(pending), timeout=_POLL_S)
            )
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._fail_died(rank)
                if message[0] == "error":
                    _, kind, text, remote = message
                    self._fail(f"rank {rank} raised {kind} during {command}: {text}")
                    raise WorkerError(
                        f"TP worker rank {rank} raised {kind} during {command}: {text}\n"
                        f"--- worker traceback ---\n{remote}",
                        rank,
                        remote,
                    )
                results[rank] = message[1]
            if not ready and not self._thread.is_alive():
                self._fail_died(min(pending.values()))
            if deadline is not None and time.monotonic() > deadline and pending:
                waiting = sorted(pending.values())
                self._fail(f"ranks {waiting} did not answer {command} within {timeout:.0f} s")
                raise TimeoutError(
                    f"TP workers {waiting} did not answer {command} within {timeout:.0f} s; the "
                    "workers were stopped"
                )
        return results

    def _fail(self, reason: str) -> None:
        self._broken = reason
        self.kill()

    def _fail_died(self, rank: int) -> None:
        """A worker's pipe closed: wait for the agent's report, stop the rest, raise."""
        self._thread.join(_AGENT_REPORT_WAIT_S)
        report = ""
        if self._launch_error is not None:
            report = f"\n--- elastic agent report ---\n{self._launch_error}"
        pid = self._pids[rank] if rank < len(self._pids) else None
        reason = f"TP worker rank {rank} (pid {pid}) died without answering"
        self._fail(reason)
        raise WorkerDiedError(reason + report, rank)

    # Shutdown ----------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Ask every worker to leave, wait for the agent, end stragglers; idempotent."""
        if self._closed:
            return
        try:
            if self._broken is None and self._thread.is_alive():
                with contextlib.suppress(Exception):
                    self.request("close", timeout=timeout)
                self._thread.join(timeout)
        finally:
            self._closed = True
            self.kill()

    def kill(self) -> None:
        """End the workers (SIGKILL to the process ids they reported) while the agent still
        watches them (once it has returned, it has stopped them all itself)."""
        if self._thread.is_alive():
            for pid in self._pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self._thread.join(_AGENT_REPORT_WAIT_S)
        for conn in self._conns:
            conn.close()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()


@atexit.register
def _close_all() -> None:  # registered after multiprocessing's handler, so it runs first
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool.close(timeout=10.0)
