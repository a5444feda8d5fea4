"""NxDPPModel's own DP gradient average refuses expert weights at EP > 1 (it would mix
different experts' gradients); at EP = 1, or without expert weights, it goes ahead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nxd_pipeline._model import _refuse_expert_parameters


def _named(expert: bool) -> dict[str, nn.Parameter]:
    dense, experts = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(4, 2))
    if expert:
        experts.expert_model_parallel = True  # type: ignore[attr-defined]  # as nxd_layers.moe
    return {"dense.weight": dense, "moe.expert_mlps.gate_up_proj": experts}


def test_expert_weights_at_ep2_are_refused() -> None:
    with pytest.raises(NotImplementedError, match=r"expert_model_parallel_size=2.*gate_up_proj"):
        _refuse_expert_parameters(_named(expert=True), 2)


def test_ep1_or_no_expert_weights_go_ahead() -> None:
    for named, ep in ((_named(expert=True), 1), (_named(expert=False), 2)):
        _refuse_expert_parameters(named, ep)  # raises on refusal (see the test above)
        assert (
            not any(getattr(p, "expert_model_parallel", False) for p in named.values()) or ep == 1
        )
