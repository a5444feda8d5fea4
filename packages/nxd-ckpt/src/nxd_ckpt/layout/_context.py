"""Where this process sits (TP/PP/DP/EP coordinates) and the few collectives saving needs.

Works without torch.distributed (a world of one) and without an nxd parallel state (every
rank is a data-parallel replica). With expert parallelism (EP) the EP group is carved out of
DP x CP: a non-expert tensor is replicated over the n = DP x CP ranks of its (TP, PP)
coordinate, an expert tensor (``expert_model_parallel``) only over the n / EP ranks of its
expert-DP group, which hold the same experts. Errors found on some ranks are made collective with
:func:`agree` before anyone raises, so no rank is left waiting in a later collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RankContext", "agree", "barrier", "broadcast_int", "current_context", "sum_counts"]


@dataclass(frozen=True)
class RankContext:
    """This process's ranks and the degrees of the layout it runs in."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    local_rank: int
    distributed: bool
    ep_rank: int = 0
    """Position in the EP group: this rank holds experts [ep_rank E/ep, (ep_rank+1) E/ep)."""
    ep_size: int = 1
    edp_rank: int | None = None
    """Position among the replicas of this rank's experts (None: ``dp_rank``, EP = 1)."""
    edp_size: int | None = None
    """Replicas of this rank's experts, DP x CP / EP (None: ``dp_size``, EP = 1)."""

    @property
    def expert_dp_rank(self) -> int:
        return self.dp_rank if self.edp_rank is None else self.edp_rank

    @property
    def expert_dp_size(self) -> int:
        return self.dp_size if self.edp_size is None else self.edp_size

    def refuse_expert_parallel(self, what: str, reason: str) -> None:
        """Raise for ``what`` at EP > 1 (a path that would drop or mix up experts)."""
        if self.ep_size > 1:
            raise NotImplementedError(
                f"{what} at expert_model_parallel_size={self.ep_size}: {reason}"
            )

    def parallel_dict(self, zero1: bool) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "tensor_parallel_size": self.tp_size,
            "pipeline_parallel_size": self.pp_size,
            "data_parallel_size": self.dp_size,
            "expert_model_parallel_size": self.ep_size,
            "zero1": zero1,
        }

    @property
    def coordinates(self) -> str:
        return f"dp_rank_{self.dp_rank:02d}_tp_rank_{self.tp_rank:02d}_pp_rank_{self.pp_rank:02d}"


def current_context() -> RankContext:
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    from nxd_state import get_parallel_state, model_parallel_is_initialized

    if distributed and model_parallel_is_initialized():
        state = get_parallel_state()
        # The replica axis is DP x CP: weights are replicated over both alike and ZeRO-1
        # shards its state over both (so the DP x CP rank names a replica's files). Expert
        # weights are replicated over the expert-DP group only (EP ranks hold other experts).
        return RankContext(
            rank=rank,
            world_size=world,
            tp_rank=state.tensor_parallel_rank,
            tp_size=state.tensor_parallel_size,
            pp_rank=state.pipeline_parallel_rank,
            pp_size=state.pipeline_parallel_size,
            dp_rank=state.data_context_parallel_ranks.index(rank),
            dp_size=state.data_context_parallel_size,
            local_rank=local_rank,
            distributed=True,
            ep_rank=state.expert_model_parallel_rank,
            ep_size=state.expert_model_parallel_size,
            edp_rank=state.expert_data_parallel_rank,
            edp_size=state.expert_data_parallel_size,
        )
    return RankContext(rank, world, 0, 1, 0, 1, rank, world, local_rank, distributed)


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
