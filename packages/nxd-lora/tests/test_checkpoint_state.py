"""LoRAModel describes its own checkpoint state: what each save mode stores, decided in one
place (LoraConfig.save_mode). One process, no checkpoint written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nxd_lora import LoraConfig, LoRAModel
from nxd_state.shards import CheckpointMetadata, CheckpointState, current_rank_context


def _model(**flags: bool) -> LoRAModel:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return LoRAModel(base, LoraConfig(target_modules=["0"], lora_rank=2, **flags))


@pytest.mark.parametrize(
    ("flags", "mode", "names"),
    [
        ({}, "adapter", ["0.lora_A.weight", "0.lora_B.weight"]),
        (
            {"save_lora_base": True},
            "base_and_adapter",
            ["0.bias", "0.lora_A.weight", "0.lora_B.weight", "0.weight", "1.bias", "1.weight"],
        ),
        (
            {"save_lora_base": True, "merge_lora": True},
            "merged",
            ["0.bias", "0.weight", "1.bias", "1.weight"],
        ),
    ],
)
def test_each_save_mode_names_what_it_stores(
    flags: dict[str, bool], mode: str, names: list[str]
) -> None:
    model = _model(**flags)
    assert isinstance(model, CheckpointState)
    assert isinstance(model, CheckpointMetadata)
    described = model.checkpoint_tensors(current_rank_context())
    assert sorted(t.name for t in described.tensors) == names
    assert model.checkpoint_metadata()["lora"]["mode"] == mode


def test_merged_saves_w_plus_s_ba_and_loads_into_the_base_weight() -> None:
    """merged: a save stores W + s·BA (s = alpha / r), a load fills W itself."""
    model = _model(save_lora_base=True, merge_lora=True)
    layer = model.module[0]
    with torch.no_grad():
        layer.lora_B.weight.normal_()  # B = 0 at init: make the merge visible
    ctx = current_rank_context()
    saved = {t.name: t.tensor for t in model.checkpoint_tensors(ctx).tensors}
    loaded = {t.name: t.tensor for t in model.checkpoint_tensors(ctx, for_load=True).tensors}
    scale = model.lora_config.scaling
    expected = layer.base_layer.weight + scale * layer.lora_B.weight @ layer.lora_A.weight
    torch.testing.assert_close(saved["0.weight"], expected)  # same math, float32 rounding
    assert loaded["0.weight"] is layer.base_layer.weight


def test_merge_sharded_lora_saves_the_adapter_alone_even_when_set_late() -> None:
    """NxD: merge_sharded_lora turns save_lora_base and merge_lora off; the mode says so even
    if the flags are changed after the config was made (one place decides the mode)."""
    config = LoraConfig(target_modules=["0"], save_lora_base=True)
    config.merge_sharded_lora = True
    assert config.save_mode == "adapter"
