"""LoRA through ``save_checkpoint``: NxD's three save modes, ``load_lora_from_ckpt`` and a
PEFT export (2 gloo ranks, TP=2, a tiny Hugging Face Llama; no download).

An adapter trains 2 SGD steps on the TP=2 Llama; each mode is saved, then loaded into a model
that starts elsewhere (a new adapter, and for base + adapter and merged a *different random
base*), which must reproduce the trained logits:

* adapter only: ``load_lora_from_ckpt`` (``lora_save_dir`` / ``lora_load_tag``) onto the
  original base: logits equal bitwise (same weights, same computation);
* base + adapter: onto a different base: equal bitwise (the base is restored too);
* merged: into a plain TP=2 Llama (no LoRA) with a different base: W + s·BA replaces two
  matmuls by one, so logits agree to fp32 reassociation: rtol 1e-5, atol 1e-5 (O(1) logits);
* the adapter-only tag exported with ``export_hf`` loads with ``peft.PeftModel`` on the
  unsharded Llama: the same tolerance (TP=2 splits the projections' reductions).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from nxd_ckpt import export_hf, load_checkpoint, read_index, save_checkpoint
from nxd_ckpt.lora import load_lora_from_ckpt
from nxd_ckpt.testing import tensor_parallel_llama
from nxd_state.testing import add_preload, run_distributed

add_preload("transformers.models.llama.modeling_llama", "nxd_lora")

TOL = {"rtol": 1e-5, "atol": 1e-5}  # see the module docstring
EXACT = {"rtol": 0.0, "atol": 0.0}
VOCAB = 96
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def _llama(path: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def bases(tmp_path: Path) -> tuple[Path, Path]:
    return _llama(tmp_path / "base", 0), _llama(tmp_path / "other", 1)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=_batch()).logits


def _lora(base: str, seed: int, **config: object):
    from nxd_lora import LoraConfig, LoRAModel

    torch.manual_seed(seed)
    settings = {"enable_lora": True, "lora_rank": 4, "lora_alpha": 8, "target_modules": TARGETS}
    return LoRAModel(tensor_parallel_llama(base), LoraConfig(**{**settings, **config}))


def modes(base: str, other: str, ckpt: str) -> dict[str, torch.Tensor]:
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = _lora(base, seed=0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = _batch()
    for _ in range(2):  # B leaves zero, then A and B both move
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"trained": _logits(model)}
    model.train()
    settings = {
        "adapter": {},
        "base_and_adapter": {"save_lora_base": True},
        "merged": {"save_lora_base": True, "merge_lora": True},
    }
    for tag, fields in settings.items():
        model.lora_config = dataclasses.replace(model.lora_config, **fields)
        save_checkpoint(ckpt, tag, model=model)

    adapter = _lora(base, seed=1, lora_save_dir=ckpt, lora_load_tag="adapter")
    out["untrained"] = _logits(adapter)
    load_lora_from_ckpt(adapter)
    out["adapter"] = _logits(adapter)
    both = _lora(other, seed=2, lora_save_dir=ckpt, lora_load_tag="base_and_adapter")
    load_lora_from_ckpt(both)
    out["base_and_adapter"] = _logits(both)
    plain = tensor_parallel_llama(other)
    load_checkpoint(ckpt, "merged", model=plain)
    out["merged"] = _logits(plain)
    return out


def test_lora_save_modes_load_and_peft_export(tmp_path: Path, bases: tuple[Path, Path]) -> None:
    import peft
    from transformers import LlamaForCausalLM

    base, other = bases
    ckpt = tmp_path / "ckpt"
    results = run_distributed(modes, 2, str(base), str(other), str(ckpt))
    trained = results[0]["trained"]
    assert (trained - results[0]["untrained"]).abs().max() > 1e-3  # training moved the adapter
    for result in results:
        torch.testing.assert_close(result["adapter"], trained, **EXACT)
        torch.testing.assert_close(result["base_and_adapter"], trained, **EXACT)
        torch.testing.assert_close(result["merged"], trained, **TOL)

    names = {
        mode: set(read_index(ckpt / mode).tensors["model"])
        for mode in results[0]
        if (ckpt / mode).exists()
    }
    assert all(".lora_" in n for n in names["adapter"])
    assert names["base_and_adapter"] > names["adapter"]
    assert not any(".lora_" in n for n in names["merged"])

    out = export_hf(ckpt, tmp_path / "peft", tag="adapter")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    theirs = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), out)
    torch.testing.assert_close(_logits(theirs), trained, **TOL)
