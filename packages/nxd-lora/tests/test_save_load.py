"""The three save modes, PEFT-format adapters on a tiny Hugging Face Llama, and loading back.

The Llama is random-initialised from a LlamaConfig and saved to tmp_path (no download).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaForCausalLM

import nxd_lora
from nxd_lora import LoraConfig, LoRAModel

# Same weights, same ops in the same order (PEFT and nxd both add B(A(x))·s to the base
# output): only fp32 rounding can differ, and a 2-layer model keeps it at a few ulps.
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-5}
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def load_llama(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path).eval()


def randomize_(module: nn.Module, seed: int = 1) -> None:
    """Random adapter values (the default init has B = 0, which would hide a wrong mapping)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).logits


def lora_llama(base: Path, **overrides: object) -> LoRAModel:
    values: dict = {"enable_lora": True, "lora_rank": 4, "lora_alpha": 8, "target_modules": TARGETS}
    values.update(overrides)
    model = LoRAModel(load_llama(base), LoraConfig(**values))
    randomize_(model)
    return model.eval()


def test_nxd_adapter_loads_in_peft_and_back_into_nxd(tmp_path: Path, tiny_llama_dir: Path) -> None:
    base = tiny_llama_dir
    ours = lora_llama(base)
    expected = logits(ours)
    assert not torch.allclose(expected, logits(load_llama(base)))  # the adapter matters

    directory = nxd_lora.save_lora(ours, tmp_path / "lora", tag="step1")
    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["target_modules"], config["task_type"]) == (4, TARGETS, "CAUSAL_LM")
    keys = set(load_file(directory / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 2 * len(TARGETS)  # A and B, 2 layers

    with warnings.catch_warnings(record=True) as caught:  # PEFT loads it without complaint
        warnings.simplefilter("always")
        theirs = peft.PeftModel.from_pretrained(load_llama(base), directory).eval()
    complaints = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert complaints == []
    torch.testing.assert_close(logits(theirs), expected, **LOGITS_TOL)

    # NxD's load path: the saved config wins over the user's (rank 4, not 16).
    reloaded = LoRAModel(
        load_llama(base),
        LoraConfig(
            enable_lora=True,
            load_lora_from_ckpt=True,
            lora_save_dir=str(tmp_path / "lora"),
            lora_load_tag="step1",
        ),
    ).eval()
    assert reloaded.lora_config.lora_rank == 4
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=0)


def test_peft_adapter_loads_into_nxd(tmp_path: Path, tiny_llama_dir: Path) -> None:
    base = tiny_llama_dir
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_rslora=True)
    theirs = peft.get_peft_model(load_llama(base), peft_config)
    randomize_(theirs)
    theirs.eval()
    theirs.save_pretrained(tmp_path / "peft")
    ours = LoRAModel(
        load_llama(base),
        LoraConfig(lora_rank=4, lora_alpha=8, target_modules=TARGETS, use_rslora=True),
    ).eval()
    nxd_lora.load_peft_adapter(ours, tmp_path / "peft")
    torch.testing.assert_close(logits(ours), logits(theirs), **LOGITS_TOL)


def test_mismatched_adapters_raise(tmp_path: Path, tiny_llama_dir: Path) -> None:
    base = tiny_llama_dir
    nxd_lora.save_lora(lora_llama(base), tmp_path / "lora")
    other_rank = LoRAModel(
        load_llama(base), LoraConfig(lora_rank=8, lora_alpha=8, target_modules=TARGETS)
    )
    with pytest.raises(ValueError, match=r"does not match this LoRA model.*lora_rank: 8 vs 4"):
        nxd_lora.load_peft_adapter(other_rank, tmp_path / "lora")
    fewer = LoRAModel(
        load_llama(base), LoraConfig(lora_rank=4, lora_alpha=8, target_modules=["q_proj"])
    )
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.0.mlp.down_proj"):
        nxd_lora.load_peft_adapter(fewer, tmp_path / "lora")
    more = LoRAModel(
        load_llama(base), LoraConfig(lora_rank=4, lora_alpha=8, target_modules=[*TARGETS, "k_proj"])
    )
    with pytest.raises(ValueError, match=r"has no tensor 'model.layers.0.self_attn.k_proj"):
        nxd_lora.load_peft_adapter(more, tmp_path / "lora")
    state = fewer.state_dict()
    state["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(2, 32)
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight: checkpoint \(2, 32\) vs model"):
        fewer.load_state_dict(state)
    with pytest.raises(FileNotFoundError, match="no LoRA checkpoint in"):
        LoRAModel(
            load_llama(base),
            LoraConfig(load_lora_from_ckpt=True, lora_save_dir=str(tmp_path / "missing")),
        )


def test_save_mode_state_dicts(tmp_path: Path, tiny_llama_dir: Path) -> None:
    base = tiny_llama_dir
    plain_keys = set(load_llama(base).state_dict())
    adapter = lora_llama(base)
    adapter_keys = set(adapter.state_dict())
    assert adapter_keys == {k for k in adapter_keys if ".lora_" in k}
    assert len(adapter_keys) == 2 * 2 * len(TARGETS)

    both = lora_llama(base, save_lora_base=True)
    assert set(both.state_dict()) == plain_keys | adapter_keys  # base under original names

    merged = lora_llama(base, save_lora_base=True, merge_lora=True)
    merged_state = merged.state_dict()
    assert set(merged_state) == plain_keys
    plain = load_llama(base)
    plain.load_state_dict(merged_state)  # a plain model with the merged weights ...
    # ... computes what the LoRA model computes: W + s·BA vs two matmuls, fp32 reassociation
    torch.testing.assert_close(logits(plain), logits(merged), rtol=1e-5, atol=1e-5)
    assert not merged.is_lora_merged  # saving merged does not touch the model

    # The adapter-only state dict loads into a fresh LoRA model and reproduces it.
    fresh = LoRAModel(load_llama(base), copy.deepcopy(adapter.lora_config)).eval()
    fresh.load_state_dict(adapter.state_dict())
    torch.testing.assert_close(logits(fresh), logits(adapter), rtol=0, atol=0)


@pytest.mark.parametrize("config_in_adapter", [True, False])
def test_save_modes_on_disk_and_reload(
    tmp_path: Path, tiny_llama_dir: Path, config_in_adapter: bool
) -> None:
    base = tiny_llama_dir
    both = lora_llama(
        base, save_lora_base=True, save_lora_config_adapter=config_in_adapter, lora_rank=2
    )
    directory = nxd_lora.save_lora(both, tmp_path / "ckpt", tag="t")
    assert sorted(p.name for p in directory.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "model.safetensors",
    ]
    assert (tmp_path / "ckpt" / "adapter_config.json").is_file() != config_in_adapter
    reloaded = LoRAModel(
        LlamaForCausalLM(load_llama(base).config),  # fresh random base: the file's base wins
        LoraConfig(
            load_lora_from_ckpt=True, lora_save_dir=str(tmp_path / "ckpt"), lora_load_tag="t"
        ),
    ).eval()
    assert reloaded.lora_config.lora_rank == 2
    torch.testing.assert_close(logits(reloaded), logits(both), rtol=0, atol=0)

    merged = lora_llama(base, save_lora_base=True, merge_lora=True)
    merged.save_lora(str(tmp_path / "merged"))  # NxD's method spelling
    directory = tmp_path / "merged"
    assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors"]
    plain = load_llama(base)
    plain.load_state_dict(load_file(directory / "model.safetensors"))
    torch.testing.assert_close(logits(plain), logits(merged), rtol=1e-5, atol=1e-5)
    # NxD: loading a merged checkpoint restores the merged base and injects no adapter.
    restored = LoRAModel(
        LlamaForCausalLM(load_llama(base).config),
        LoraConfig(load_lora_from_ckpt=True, lora_save_dir=str(directory)),
    ).eval()
    assert restored.lora_module_names == []
    assert restored.lora_config.merge_lora
    torch.testing.assert_close(logits(restored), logits(plain), rtol=0, atol=0)
