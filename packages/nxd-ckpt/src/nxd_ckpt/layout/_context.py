"""Where this process sits (TP/PP/DP/EP coordinates) and the few collectives saving needs.

:class:`RankContext` lives upstream (:mod:`nxd_state.shards`: the checkpoint protocol takes it);
it is re-exported here under its old name.

Works without torch.distributed (a world of one) and without an nxd parallel state (every
rank is a data-parallel replica). With expert parallelism (EP) the EP group is carved out of
DP x CP: a non-expert tensor is replicated over the n = DP x CP ranks of its (TP, PP)
coordinate, an expert tensor (``expert_model_parallel``) only over the n / EP ranks of its
expert-DP group, which hold the same experts. Errors found on some ranks are made collective with
:func:`agree` before anyone raises, so no rank is left waiting in a later collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nxd_state.shards import RankContext, current_rank_context

__all__ = ["RankContext", "agree", "barrier", "broadcast_int", "current_context", "sum_counts"]


def current_context() -> RankContext:
    """This process's :class:`RankContext` (:func:`nxd_state.shards.current_rank_context`)."""
    return current_rank_context()


def _device() -> torch.device:
    from nxd_state import current_device

    backend = str(dist.get_backend()).lower() if dist.is_initialized() else "gloo"
    return torch.device("cpu") if backend == "gloo" else current_device()


def sum_counts(values: list[int]) -> list[int]:
    """Element-wise sum over every rank of an int vector (same length everywhere)."""
    if not (dist.is_available() and dist.is_initialized()) or not values:
        return list(values)
    from nxd_state import collectives

    tensor = torch.tensor(values, dtype=torch.int64, device=_device())
    collectives.all_reduce(tensor)
    return [int(v) for v in tensor.tolist()]


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank has an ``error`` (the failing ranks raise their own).

    Ranks without an error raise a RuntimeError naming the ranks that failed.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    world = dist.get_world_size()
    flags = [0] * world
    flags[dist.get_rank()] = int(error is not None)
    failed = [rank for rank, flag in enumerate(sum_counts(flags)) if flag]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {failed}; see their errors")


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        from nxd_state import collectives

        collectives.barrier()


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank (63-bit)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    from nxd_state import collectives

    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    collectives.broadcast(tensor, src=src)
    return int(tensor.item())
