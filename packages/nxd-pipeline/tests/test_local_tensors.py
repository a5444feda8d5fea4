"""Moving a rank's stages to their device keeps tied weights tied and parameter attributes."""

from __future__ import annotations

import torch
from torch import nn

from nxd_pipeline._materialize import move_local_tensors


def test_moving_stages_keeps_weights_tied_across_them() -> None:
    # meta stands in for a device whose tensors cannot take a CPU parameter's place in
    # place (XLA): every holder must get the same new parameter, with its attributes.
    embedding, head = nn.Embedding(4, 3), nn.Linear(3, 4, bias=False)
    head.weight = embedding.weight
    embedding.weight.tensor_model_parallel = True
    embedding.register_buffer("table", torch.ones(2))
    stages = [nn.ModuleList([embedding]), nn.ModuleList([head])]  # two stages of one rank
    assert move_local_tensors(stages, torch.device("meta")) == 2  # the weight once, the buffer
    assert head.weight is embedding.weight
    assert embedding.weight.is_meta
    assert isinstance(embedding.weight, nn.Parameter)
    assert embedding.weight.tensor_model_parallel
    assert embedding.table.is_meta
    assert move_local_tensors(stages, torch.device("meta")) == 0  # already there
