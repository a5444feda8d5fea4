"""NxD's ``neuronx_distributed.utils`` and ``overrides`` helpers, imported from NxD's paths."""

from __future__ import annotations

import logging

import pytest
import torch


def test_rotary_override_equals_transformers_llama() -> None:
    from transformers.models.llama import modeling_llama

    from neuronx_distributed.overrides.transformer_overrides import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    b, heads, s, d = 2, 3, 5, 8
    q, k = (torch.randn(b, heads, s, d, generator=generator) for _ in range(2))
    table_cos, table_sin = (torch.randn(16, d, generator=generator) for _ in range(2))
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    want = modeling_llama.apply_rotary_pos_emb(
        q, k, table_cos[position_ids], table_sin[position_ids]
    )
    got = apply_rotary_pos_emb(q, k, table_cos, table_sin, position_ids, flash_attn=False)
    # the same products and sums, in the same order: exact
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # gathered cos/sin (position_ids=None) and the transposed flash-attention layout agree too
    gathered = apply_rotary_pos_emb(
        q, k, table_cos[position_ids], table_sin[position_ids], None, flash_attn=False
    )
    transposed = apply_rotary_pos_emb(
        q.transpose(-1, -2), k.transpose(-1, -2), table_cos, table_sin, position_ids, True
    )
    for plain, flash, theirs in zip(gathered, transposed, want):
        torch.testing.assert_close(plain, theirs, rtol=0, atol=0)
        torch.testing.assert_close(flash.transpose(-1, -2), theirs, rtol=0, atol=0)


def test_shift_labels_pads_with_the_ignore_index() -> None:
    from neuronx_distributed.utils.batch_utils import shift_labels

    batch = {"input_ids": torch.arange(6).view(2, 3), "labels": torch.arange(6).view(2, 3)}
    shifted = shift_labels(batch)
    assert torch.equal(shifted["labels"], torch.tensor([[1, 2, -100], [4, 5, -100]]))
    assert shifted["input_ids"] is batch["input_ids"]
    with pytest.raises(
        ValueError, match=r"labels must be \(batch, sequence, \.\.\.\), got shape \(3,\)"
    ):
        shift_labels({"labels": torch.arange(3)})


def test_log_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronx_distributed.utils.logger import get_log_level

    monkeypatch.setenv("NXD_LOG_LEVEL", "warning")
    assert get_log_level() == logging.WARNING
    monkeypatch.setenv("NXD_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match=r"NXD_LOG_LEVEL must be one of .* got 'loud'"):
        get_log_level()


def test_device_helpers_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronx_distributed.utils import cpu_mode, get_device, mark_step
    from neuronx_distributed.utils.model_utils import get_local_world_size

    monkeypatch.setenv("NXD_DEVICE", "cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_mode() is True
    assert get_device() == torch.device("cpu")
    mark_step()  # eager device: nothing to cut, and no torch_xla import
    import sys

    assert "torch_xla" not in sys.modules
    assert get_local_world_size() == 4


def test_init_on_meta_device_allocates_nothing() -> None:
    from torch import nn

    from neuronx_distributed.utils.model_utils import init_on_device

    with init_on_device(torch.device("meta")):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        model[1].weight.requires_grad_(False)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert (model[0].weight.requires_grad, model[1].weight.requires_grad) == (True, False)
    assert torch.ones(1).device.type == "cpu"  # untouched without include_buffers
    model.to_empty(device="cpu")
    assert model(torch.ones(2, 4)).shape == (2, 8)
