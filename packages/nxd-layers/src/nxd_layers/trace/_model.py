"""The module a trace or a load returns: TP workers behind one ``forward``."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from nxd_layers.trace._inputs import Signature, decode, describe, encode, find_bucket
from nxd_layers.trace._pool import WorkerPool

__all__ = ["ParallelModel", "TensorParallelModel"]


class ParallelModel(nn.Module):
    """NxD's base class of traced parallel models (``isinstance`` checks)."""


class TensorParallelModel(ParallelModel):
    """Y = model(*inputs), computed by every TP rank's traced program; rank 0's Y is returned.

    Each call is matched to a bucket by its inputs' structure, dtypes and shapes (an error
    naming the shapes when none fits, before any worker runs), sent to every worker, and the
    outputs of rank 0 come back (on CPU). The workers live until :meth:`close` (or the end of
    a ``with`` block, or interpreter exit); a worker that dies or raises makes the call raise
    :class:`~nxd_layers.trace.WorkerError` and ends the others. ``last_compute_seconds``:
    rank 0's forward time of the last call, measured in the worker (without transfers).
    """

    def __init__(
        self,
        pool: WorkerPool,
        buckets: list[Signature],
        info: dict[str, Any],
        *,
        call_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._pool = pool
        self.buckets = buckets
        self.tp_degree = pool.tp_degree
        self.info = info
        self.call_timeout = call_timeout
        self.last_compute_seconds: float | None = None

    def forward(self, *inputs: Any) -> Any:
        bucket = find_bucket(self.buckets, inputs)
        replies = self._pool.request("run", (bucket, encode(inputs)), timeout=self.call_timeout)
        data, self.last_compute_seconds = replies[0]
        return decode(data)

    @property
    def closed(self) -> bool:
        return not self._pool.alive

    def close(self) -> None:
        """End the workers (idempotent)."""
        self._pool.close()

    def __enter__(self) -> TensorParallelModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._pool.close(timeout=10.0)

    def extra_repr(self) -> str:
        buckets = ", ".join(describe(b) for b in self.buckets)
        route = "eager" if self.info.get("eager") else self.info.get("backend", "export")
        return f"tp_degree={self.tp_degree}, route={route}, buckets=[{buckets}]"
