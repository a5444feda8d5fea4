"""The export's ``config.json`` / ``generation_config.json`` (one process, no process group).

A tokenizer whose end-of-text token is id 5 (id 2 is ``"``, Llama's default EOS): a model
saved with Llama's default ids (bos 1, eos 2) is refused at export with both ids named, with
the tokenizer as an object and as a folder; saved with the tokenizer's ids, the export's
``config.json`` has them, ``use_cache: true`` (training had it off) and the model class the
save recorded in ``architectures`` (the model was built with ``from_config``, which leaves it
unset), and ``generation_config.json`` has them too, as transformers reads it. ``token_ids=``
and an explicit ``config=`` are the caller's word; a config without a pad id takes the
tokenizer's; a list of EOS ids agrees when it holds the tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_ckpt import export_hf, save_checkpoint
from nxd_ckpt.sources._hf_config import export_configs, tokenizer_ids

VOCAB = {"<pad>": 0, "<s>": 1, '"': 2, "a": 3, "b": 4, "<|endoftext|>": 5}
VOCAB.update({f"t{i}": i for i in range(6, 16)})
IDS = {"bos_token_id": 1, "eos_token_id": 5, "pad_token_id": 0}


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>", pad_token="<pad>"
    )


def _checkpoint(root: Path, **ids: int) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, **ids,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False  # as training sets it
    save_checkpoint(root, "t", model=model)
    return root / "t"


def test_tokenizer_ids_from_an_object_and_a_folder(tmp_path: Path) -> None:
    tok = tokenizer()
    tok.save_pretrained(tmp_path)
    expected = {"bos_token_id": ("<s>", 1), "eos_token_id": ("<|endoftext|>", 5)}
    expected["pad_token_id"] = ("<pad>", 0)
    assert tokenizer_ids(tok) == expected
    assert tokenizer_ids(str(tmp_path)) == expected


def test_config_ids_agree_with_the_tokenizer_or_the_export_is_refused() -> None:
    tok = tokenizer()
    saved = {"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2, "use_cache": False}
    with pytest.raises(ValueError, match=r"eos_token_id is 2 but the tokenizer's eos_token "):
        export_configs(saved, tokenizer=tok, token_ids=None, explicit_config=False)
    config, generation = export_configs(
        saved, tokenizer=tok, token_ids={"eos_token_id": 5}, explicit_config=False
    )
    assert (config["eos_token_id"], config["use_cache"]) == (5, True)
    assert generation == {"bos_token_id": 1, "eos_token_id": 5}
    config, _ = export_configs(saved, tokenizer=tok, token_ids=None, explicit_config=True)
    assert config["eos_token_id"] == 2  # the caller's explicit config, as given
    config, generation = export_configs(
        {**saved, "eos_token_id": [5, 7]}, tokenizer=tok, token_ids=None, explicit_config=False
    )
    assert generation == {"bos_token_id": 1, "eos_token_id": [5, 7], "pad_token_id": 0}
    with pytest.raises(ValueError, match=r"token_ids keys must be among"):
        export_configs(saved, tokenizer=None, token_ids={"eos": 5}, explicit_config=False)


def test_export_writes_the_tokenizer_ids_use_cache_and_architectures(tmp_path: Path) -> None:
    import transformers

    tok = tokenizer()
    wrong = _checkpoint(tmp_path / "wrong")  # Llama's defaults: bos 1, eos 2
    for given in (tok, str(tmp_path / "tok")):
        tok.save_pretrained(tmp_path / "tok")
        with pytest.raises(ValueError, match=r"eos_token_id is 2 .* '<\|endoftext\|>' is id 5"):
            export_hf(wrong, tmp_path / "refused", tokenizer=given)
    right = _checkpoint(tmp_path / "right", bos_token_id=1, eos_token_id=5)
    out = export_hf(right, tmp_path / "hf", tokenizer=tok)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["use_cache"], config["eos_token_id"], config["pad_token_id"]) == (True, 5, 0)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 5)
    assert generation.pad_token_id == 0
    assert transformers.AutoConfig.from_pretrained(out).use_cache is True
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == 5
