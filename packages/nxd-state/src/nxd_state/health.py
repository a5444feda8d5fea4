"""Rank death and hangs: the collective timeout nxd configures, and naming the rank that failed.

A collective on ``n`` ranks completes only when all ``n`` take part, so one dead rank stops
its peers. Two guarantees bound the damage:

* **Every wait is bounded.** :func:`collective_timeout` is the timeout
  :func:`nxd_state.init_distributed` passes to ``init_process_group`` (gloo: each operation;
  NCCL: the watchdog, which aborts the communicator), ``NXD_COLLECTIVE_TIMEOUT_S`` seconds,
  default :data:`DEFAULT_TIMEOUT_S` (30 min: long enough for a slow checkpoint load on one rank
  while the others wait at a barrier, short enough that a lost rank ends the job).
* **The failure names the dead rank.** Every rank records ``(host, pid, start time)`` in the
  rendezvous store when the process group is made (:func:`install`), and how it ended (the
  exception that ended it, or a plain exit) when it ends. When a collective in
  :mod:`nxd_state.collectives` fails, :func:`diagnose` reads those records: a rank whose
  process is gone (on this host: ``/proc``) without an exit record was killed; a rank that
  recorded an exception raised it. The collective's error becomes a :class:`RankFailureError`
  naming them, the original error chained. A collective that timed out with every peer alive
  names the peers that never joined.

``NXD_RANK_HEALTH=0`` turns the records off (the timeout stays). A rank killed on another
host leaves no record and cannot be probed from here: it is reported as "no exit record,
on host H" rather than as dead.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankFailureError",
    "collective_timeout",
    "diagnose",
    "explain",
    "group_timeout",
    "install",
    "record_end",
    "set_group_timeout",
]

DEFAULT_TIMEOUT_S = 1800.0
_TIMEOUT_ENV = "NXD_COLLECTIVE_TIMEOUT_S"
_PREFIX = "nxd/health"
_STORE_TIMEOUT = datetime.timedelta(seconds=10)
_SETTLE_S = 3.0

F = TypeVar("F", bound=Callable[..., Any])


class RankFailureError(RuntimeError):
    """A collective failed because another rank died, raised, exited or never joined."""


def collective_timeout() -> datetime.timedelta:
    """``NXD_COLLECTIVE_TIMEOUT_S`` (a positive number of seconds), else 30 minutes."""
    text = os.environ.get(_TIMEOUT_ENV)
    if text is None or text == "":
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"{_TIMEOUT_ENV}={text!r}: expected a positive number of seconds (default "
            f"{DEFAULT_TIMEOUT_S:.0f})"
        )
    return datetime.timedelta(seconds=seconds)


_configured: datetime.timedelta | None = None


def set_group_timeout(timeout: datetime.timedelta) -> None:
    """The timeout the default group was made with (``init_distributed`` calls this), for the
    subgroups :func:`group_timeout` serves."""
    global _configured
    _configured = timeout


def group_timeout() -> datetime.timedelta:
    """The timeout for nxd's process groups: torch's ``new_group`` does not inherit the
    default group's, so every group nxd builds is given it explicitly (the one
    ``init_distributed`` used, else :func:`collective_timeout`)."""
    return _configured if _configured is not None else collective_timeout()


def _enabled() -> bool:
    return os.environ.get("NXD_RANK_HEALTH", "1") != "0"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (``/proc/<pid>/stat`` field 22), or None when
    the process is gone or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


class _Recorder:
    """This process's records in the store: where it runs, and how it ended."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.ended = False
        self._lock = threading.Lock()
        self._previous_hook = sys.excepthook

    def start(self) -> None:
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": _start_time(os.getpid()) if sys.platform.startswith("linux") else None,
        }
        self.store.set(f"{_PREFIX}/proc/{self.rank}", json.dumps(record))
        sys.excepthook = self._excepthook
        atexit.register(self.end, "exited (end of script or sys.exit)")
        # os._exit and signals skip both: such a rank is found dead by its pid.

    def end(self, how: str) -> None:
        with self._lock:
            if self.ended:
                return
            self.ended = True
        with contextlib.suppress(Exception):  # the store may be gone with its host
            self.store.set(f"{_PREFIX}/exit/{self.rank}", how)

    def _excepthook(
        self, kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        summary = traceback.format_exception_only(kind, error)[-1].strip()
        self.end(f"raised {summary[:500]}")
        self._previous_hook(kind, error, tb)


_recorder: _Recorder | None = None


def install() -> None:
    """Record this rank in the default group's store (called by ``init_distributed``).

    Also chains ``sys.excepthook`` (an uncaught exception is recorded as this rank's end,
    then printed as before) and registers an ``atexit`` record. A launcher that ends its
    ranks itself can call :func:`record_end`.
    """
    global _recorder
    if not _enabled() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = _default_store()
    if store is None:
        return
    _recorder = _Recorder(store, dist.get_rank())
    _recorder.start()


def record_end(how: str) -> None:
    """Record how this rank ends (first record wins), for launchers that end ranks themselves:
    ``"raised <error>"`` for a failure, anything else for an exit."""
    if _recorder is not None:
        _recorder.end(how)


def _default_store() -> Any:
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    with contextlib.suppress(Exception):
        store.set_timeout(_STORE_TIMEOUT)
    return store


def _read(store: Any, key: str) -> str | None:
    if not store.check([key]):
        return None
    return store.get(key).decode()


def _rank_status(store: Any, rank: int, here: str) -> tuple[str, str]:
    """(kind, words) for one peer: "dead", "raised", "exited", "alive" or "unknown"."""
    ended = _read(store, f"{_PREFIX}/exit/{rank}")
    proc = _read(store, f"{_PREFIX}/proc/{rank}")
    where = ""
    alive: bool | None = None
    if proc is not None:
        info = json.loads(proc)
        where = f"pid {info['pid']} on {info['host']}"
        if info["host"] == here and info["start"] is not None:
            alive = _start_time(info["pid"]) == info["start"]
    if ended is not None:
        kind = "raised" if ended.startswith("raised") else "exited"
        if kind == "raised" and RankFailureError.__name__ in ended:
            kind = "exited"  # it failed because of another rank: not a cause
        return kind, f"rank {rank} ({where}) {ended}"
    if alive is False:
        return "dead", (
            f"rank {rank} ({where}) died without recording an exit: killed by a signal "
            f"(SIGKILL, out of memory) or os._exit"
        )
    if alive is True:
        return "alive", f"rank {rank} ({where}) is alive"
    return "unknown", f"rank {rank} ({where or 'no record'}) left no exit record"


def diagnose(
    group_ranks: list[int] | None = None, *, timed_out: bool = False
) -> tuple[list[int], str]:
    """Which ranks caused a failed collective: ``(ranks, explanation)``.

    Looks at every rank of the world (a dead rank outside the group can be the cause: its
    peers failed first). Causes, most certain first: ranks dead without an exit record, then
    ranks that raised (not because of another rank), then ranks that exited. With no cause
    and ``timed_out``, the peers in ``group_ranks`` that never joined (alive, or unknown on
    another host). ``([], reason)`` when there is no cause (or the store is unreachable).
    """
    if not (_enabled() and dist.is_initialized()):
        return [], "rank health records are off"
    store = _default_store()
    if store is None:
        return [], "no rendezvous store"
    me, here = dist.get_rank(), socket.gethostname()
    try:
        statuses = {
            rank: _rank_status(store, rank, here)
            for rank in range(dist.get_world_size())
            if rank != me
        }
    except Exception as error:
        return [], f"the rendezvous store is unreachable ({error}); its host may be dead"
    for kind in ("dead", "raised", "exited"):
        causes = sorted(r for r, (k, _) in statuses.items() if k == kind)
        if causes:
            return causes, "; ".join(statuses[r][1] for r in causes)
    if timed_out:
        peers = [r for r in (group_ranks or []) if r != me]
        return peers, "no rank died; " + "; ".join(statuses[r][1] for r in peers)
    return [], "no rank died, raised or exited"


def _group_ranks(group: Any) -> list[int]:
    with contextlib.suppress(Exception):
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return []


def explain(op: str, group: Any, error: BaseException) -> BaseException:
    """The error to raise for ``error`` from ``op`` on ``group``: a :class:`RankFailureError`
    naming the ranks :func:`diagnose` finds, or ``error`` itself when it finds none."""
    ranks = _group_ranks(group)
    text = str(error).lower()
    timed_out = "timed out" in text or "timeout" in text
    causes, words = diagnose(ranks, timed_out=timed_out)
    # A peer's sockets close while it is still exiting (the kernel closes files before the
    # process becomes a zombie, and an exit record may be in flight): look again briefly.
    deadline = time.monotonic() + _SETTLE_S
    while not causes and not timed_out and time.monotonic() < deadline:
        time.sleep(0.05)
        causes, words = diagnose(ranks)
    if not causes:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"nxd rank health: {words}")
        return error
    joined = "never joined" if words.startswith("no rank died") else "failed"
    plural = "s" if len(causes) > 1 else ""
    return RankFailureError(
        f"{op} on group {ranks} {'timed out' if timed_out else 'failed'} on rank "
        f"{dist.get_rank()} of {dist.get_world_size()}: rank{plural} "
        f"{', '.join(map(str, causes))} {joined} ({words}). "
        f"Backend error: {str(error).strip()[:300]}"
    )


def checked(op: str, group_arg: int | None = 1) -> Callable[[F], F]:
    """Decorate a collective: a ``RuntimeError`` from the backend goes through :func:`explain`.

    ``group_arg``: the position of the group argument (``group=`` is looked up first).
    """

    def wrap(fn: F) -> F:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except RankFailureError:
                raise
            except RuntimeError as error:
                if not dist.is_initialized():
                    raise
                if "group" in kwargs:
                    group = kwargs["group"]
                elif group_arg is not None and len(args) > group_arg:
                    group = args[group_arg]
                else:
                    group = None
                failure = explain(op, group, error)
                if failure is error:
                    raise
                raise failure from error

        run.__name__ = fn.__name__
        run.__qualname__ = fn.__qualname__
        run.__doc__ = fn.__doc__
        run.__wrapped__ = fn  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap


class CheckedWork:
    """A non-blocking transfer whose ``wait()`` names a dead peer like the blocking ops do.

    ``keep``: a tensor the transfer uses that nothing else holds (a staging copy), kept alive
    until the work is; ``then``: run once after the first successful ``wait()`` (a staged
    receive copies its buffer into the caller's tensor there).
    """

    def __init__(
        self,
        work: Any,
        op: str,
        group: Any,
        *,
        keep: Any = None,
        then: Callable[[], Any] | None = None,
    ) -> None:
        self._work = work
        self._op = op
        self._group = group
        self._keep = keep
        self._then = then

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self._work.wait(*args, **kwargs)
        except RuntimeError as error:
            failure = explain(self._op, self._group, error)
            if failure is error:
                raise
            raise failure from error
        then, self._then = self._then, None
        if then is not None:
            then()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
