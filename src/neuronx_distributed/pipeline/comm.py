"""NxD's ``neuronx_distributed.pipeline.comm``: tensors and Python objects between neighbouring
pipeline stages.

``send`` / ``recv_from`` move tensors (nxd_pipeline's point-to-point). ``send_python_object``
/ ``recv_python_object`` move a picklable object (NxD uses them for shapes and metadata) to the
next / from the previous stage (or the reverse with ``send_next=False`` / ``recv_prev=False``):
``method="tcp"`` through the job's c10d store, ``method="gloo"`` through the gloo pipeline
group of ``parallel_state.initialize_pp_gloo_groups()``. Both ends must make the matching
calls in the same order. The payload is pickled: only ever exchange objects between ranks of
the same job (it is not a file format).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.parallel_layers.parallel_state import rmsg
from nxd_pipeline import recv_from, send

__all__ = ["recv_from", "recv_python_object", "rmsg", "send", "send_python_object"]

_METHODS = ("tcp", "gloo")
# Messages sent so far per (source, destination): the store key of the next one.
_SENT: dict[tuple[int, int], int] = {}
_RECEIVED: dict[tuple[int, int], int] = {}


def _peer(towards_next: bool) -> int:
    if towards_next:
        return parallel_state.get_pipeline_model_parallel_next_rank()
    return parallel_state.get_pipeline_model_parallel_prev_rank()


def _check_method(method: str) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def _store_key(source: int, destination: int, count: int) -> str:
    return f"nxd_pp_object/{source}->{destination}/{count}"


def send_python_object(obj: Any, send_next: bool = True, method: str = "tcp") -> None:
    """Send ``obj`` to the next pipeline stage (the previous with ``send_next=False``)."""
    _check_method(method)
    destination, source = _peer(send_next), dist.get_rank()
    data = pickle.dumps(obj)
    if method == "gloo":
        group = parallel_state.get_pp_gloo_group()
        length = torch.tensor([len(data)], dtype=torch.int64)
        dist.send(length, destination, group=group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), destination, group=group)
        return
    count = _SENT.get((source, destination), 0)
    _SENT[(source, destination)] = count + 1
    store = dist.distributed_c10d._get_default_store()
    # c10d's Store.set takes bytes as well as str (torch's stub declares str only).
    store.set(_store_key(source, destination, count), data)  # type: ignore[arg-type]


def recv_python_object(recv_prev: bool = True, method: str = "tcp") -> Any:
    """The object the previous pipeline stage (the next with ``recv_prev=False``) sent."""
    _check_method(method)
    source, destination = _peer(not recv_prev), dist.get_rank()
    if method == "gloo":
        group = parallel_state.get_pp_gloo_group()
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, source, group=group)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(payload, source, group=group)
        return pickle.loads(payload.numpy().tobytes())  # a peer rank of this job sent it
    count = _RECEIVED.get((source, destination), 0)
    _RECEIVED[(source, destination)] = count + 1
    store = dist.distributed_c10d._get_default_store()
    key = _store_key(source, destination, count)
    data = store.get(key)  # waits for the sender
    store.delete_key(key)
    return pickle.loads(data)  # a peer rank of this job sent it
