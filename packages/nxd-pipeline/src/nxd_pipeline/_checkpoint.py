"""``NxDPPModel``'s checkpoint state (the protocol of :mod:`nxd_state.shards`).

A pipeline rank holds its local stages, whose state-dict names are the original model's, so a
checkpoint saved under pipeline parallelism is the union of the stages' tensors and loads at
any PP degree. Each tensor's spec comes from its layer's sharding attributes
(:func:`nxd_layers.module_checkpoint_tensors`); a weight tied across local stages is listed
once, its other names as aliases.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from nxd_layers import module_checkpoint_tensors
from nxd_state.shards import CheckpointTensors, RankContext

__all__ = ["stage_checkpoint_tensors"]


def stage_checkpoint_tensors(stages: Iterable[nn.Module], ctx: RankContext) -> CheckpointTensors:
    """The tensors of this rank's ``stages`` under the original names, with their specs (the
    same for a save and a load: the live parameters and buffers)."""
    return module_checkpoint_tensors(list(stages), ctx)
