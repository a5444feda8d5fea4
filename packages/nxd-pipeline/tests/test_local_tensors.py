"""Moving a rank's stages to their device keeps tied weights tied and parameter attributes."""

from __future__ import annotations

import torch
from torch import nn

from nxd_pipeline._materialize import materialize_local_parameters, move_local_tensors


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


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(3.0), persistent=False)


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.rotary_emb = _Rotary()


class _Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Body()


def test_a_param_init_fn_may_replace_the_child_holding_a_meta_buffer() -> None:
    # NxD's Llama examples: param_init_fn(module) replaces a rotary embedding child when given
    # its parent, which owns no meta parameter itself; the pipeline must hand it the parent.
    with torch.device("meta"):
        root = _Root()
    seen: list[str] = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for key, child in module._modules.items():
            if isinstance(child, _Rotary):
                module._modules[key] = _Rotary()  # built on CPU
        for param in module.parameters(recurse=False):
            param.fill_(0.5)

    params = [dict(root.named_parameters())]
    buffers = [dict(root.named_buffers())]
    assert materialize_local_parameters(root, params, torch.device("cpu"), init, buffers)
    assert seen == ["Linear", "_Root", "_Body"]  # the parameter owner, then ancestors
    torch.testing.assert_close(root.model.rotary_emb.inv_freq, torch.arange(3.0))
    assert not root.model.linear.weight.is_meta
