"""NxD's ``neuronx_distributed.modules.moe``: the MoE layer of :mod:`nxd_layers.moe`, under
NxD's module paths (``routing``, ``expert_mlps``, ``model``, ``model_utils``,
``loss_function``)."""

from nxd_layers.moe import (
    ACT2FN,
    ExpertMLPs,
    ExpertMLPsCapacityFactor,
    MoE,
    MoESequenceParallelMode,
    RouterSinkhorn,
    RouterTopK,
    SharedExperts,
    load_balancing_loss_func,
    router_z_loss_func,
)

__all__ = [
    "ACT2FN",
    "ExpertMLPs",
    "ExpertMLPsCapacityFactor",
    "MoE",
    "MoESequenceParallelMode",
    "RouterSinkhorn",
    "RouterTopK",
    "SharedExperts",
    "load_balancing_loss_func",
    "router_z_loss_func",
]
