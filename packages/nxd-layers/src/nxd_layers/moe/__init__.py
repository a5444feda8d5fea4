"""Mixture of experts with expert parallelism, under NxD's names.

:class:`MoE` = a router (:class:`RouterTopK`, softmax or sigmoid; :class:`RouterSinkhorn`,
top-1) + expert MLPs (:class:`ExpertMLPsCapacityFactor`: gated SiLU experts, dropless or with
a capacity factor, sharded over the expert-parallel group with all-to-all dispatch and
combine) + optional :class:`SharedExperts`. Auxiliary losses: :func:`load_balancing_loss_func`
and :func:`router_z_loss_func`.
"""

from nxd_layers.moe._comm import all_to_all_rows
from nxd_layers.moe.dispatch import DispatchPlan, expert_capacity, plan_dispatch
from nxd_layers.moe.experts import ExpertMLPs, ExpertMLPsCapacityFactor, grouped_mm_supported
from nxd_layers.moe.loss import load_balancing_loss_func, router_z_loss_func
from nxd_layers.moe.model import MoE
from nxd_layers.moe.model_utils import ACT2FN, MoESequenceParallelMode
from nxd_layers.moe.routing import RouterBase, RouterSinkhorn, RouterTopK, sinkhorn
from nxd_layers.moe.shared_experts import SharedExperts

__all__ = [
    "ACT2FN",
    "DispatchPlan",
    "ExpertMLPs",
    "ExpertMLPsCapacityFactor",
    "MoE",
    "MoESequenceParallelMode",
    "RouterBase",
    "RouterSinkhorn",
    "RouterTopK",
    "SharedExperts",
    "all_to_all_rows",
    "expert_capacity",
    "grouped_mm_supported",
    "load_balancing_loss_func",
    "plan_dispatch",
    "router_z_loss_func",
    "sinkhorn",
]
