"""NxD's ``neuronx_distributed.utils`` and ``overrides`` helpers, imported from NxD's paths."""

from __future__ import annotations

import logging

import pytest
import torch

from nxd_state.testing import run_distributed


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


def test_reinit_model_keeps_ties_and_sharding_attributes() -> None:
    from torch import nn

    from neuronx_distributed.parallel_layers.utils import set_tensor_model_parallel_attributes
    from neuronx_distributed.utils.model_utils import init_on_device, reinit_model

    with init_on_device(torch.device("meta")):
        model = nn.Module()
        model.embed, model.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        model.head.weight = model.embed.weight  # tied, as in a Llama with tie_word_embeddings
    set_tensor_model_parallel_attributes(model.embed.weight, True, 0, 1)

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            nn.init.constant_(module.weight, 0.5)

    reinit_model(model, "cpu", init)
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.device.type == "cpu"
    assert model.embed.weight.partition_dim == 0
    assert torch.equal(model.head.weight, torch.full((8, 4), 0.5))


def test_autocast_cast_and_cpu_move_follow_nxd() -> None:
    from neuronx_distributed.parallel_layers.utils import (
        cast_if_autocast_enabled,
        move_all_tensor_to_cpu,
    )

    x, ids = torch.ones(2), torch.arange(2)
    assert cast_if_autocast_enabled(x, ids) == (x, ids)  # autocast off: the same objects
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast_x, cast_ids = cast_if_autocast_enabled(x, ids)
        (nested,) = cast_if_autocast_enabled({"a": [x]})
    assert (cast_x.dtype, cast_ids.dtype) == (torch.bfloat16, torch.int64)  # floats only
    assert nested["a"][0].dtype == torch.bfloat16
    moved = move_all_tensor_to_cpu({"a": [x, (ids,)], "b": 3})
    assert moved["b"] == 3
    assert torch.equal(moved["a"][1][0], ids)
    assert isinstance(moved["a"][1], tuple)


def _create_local_weight_shards() -> list[list[float]]:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.layers import create_local_weight

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    full = torch.arange(8.0).view(8, 1)
    plain = create_local_weight(full, 0, 4, 1)
    strided = create_local_weight(full, 0, 4, 2, out_weight=torch.empty(4, 1))
    pairs = parallel_state.get_context_model_parallel_src_tgt_pairs()
    return [plain.flatten().tolist(), strided.flatten().tolist(), pairs]


def test_create_local_weight_slices_nxds_strided_layout() -> None:
    rank0, rank1 = run_distributed(_create_local_weight_shards, 2)
    assert rank0 == [[0, 1, 2, 3], [0, 1, 4, 5], []]  # stride 2: pieces 0 and 2 of size 2
    assert rank1 == [[4, 5, 6, 7], [2, 3, 6, 7], []]  # no context-parallel pairs at CP=1
