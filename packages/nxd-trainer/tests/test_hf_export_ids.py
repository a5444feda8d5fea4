"""``nxd_trainer.hf.export_hf``: the exported folder generates as the tokenizer says.

The tokenizer's end-of-text token is id 5 (id 2, Llama's default EOS, is ``"``). A 1-layer
Llama (2 heads, 1 KV head: the GQA projection at TP 2) is made a counter: one-hot embeddings
(hidden = vocabulary), attention and MLP outputs zeroed so the residual stream is the
embedding, and an LM head whose row j reads feature j-1, so greedy decoding goes t -> t + 1.
From token 3 it writes 4, then 5 (EOS), then 6, 7 ... if nothing stops it.

Parallelised at TP 2 and saved by ``save_model_sharded_checkpoint``, the export from a model
configured with the tokenizer's ids generates ``[3, 4, 5]`` and stops; its ``config.json``
has ``use_cache: true`` and ``architectures``, filled from the family when the checkpoint
lacks them (older checkpoints); ``generation_config.json`` the ids. A model left with Llama's
default ids is refused at export, both ids named, unless ``token_ids=`` says them; what
``generate`` would do with the wrong ids is checked too (it runs past the EOS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import run_distributed

VOCAB = {"<pad>": 0, "<s>": 1, '"': 2, "a": 3, "b": 4, "<|endoftext|>": 5}
VOCAB.update({f"t{i}": i for i in range(6, 16)})
EOS = 5


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>", pad_token="<pad>"
    )


def counter(**ids: int) -> torch.nn.Module:
    """The counting Llama (see the module docstring), built with ``from_config``."""
    import transformers

    n = len(VOCAB)
    config = transformers.LlamaConfig(
        vocab_size=n, hidden_size=n, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, **ids,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(10 * torch.eye(n))
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(torch.eye(n).roll(1, dims=0))  # row j = e_{j-1}
        model.lm_head.weight[0].zero_()
    model.config.use_cache = False  # as training sets it
    return model


def save(root: str) -> None:
    import nxd_state
    from nxd_trainer.hf import ParallelizersManager

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    for name, ids in (("right", {"bos_token_id": 1, "eos_token_id": EOS}), ("wrong", {})):
        model = counter(**ids)
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
        parallel = parallelizer.parallelize(model)
        assert any(n.endswith("qkv_proj.weight_k") for n, _ in parallel.named_parameters())
        parallelizer.save_model_sharded_checkpoint(parallel, Path(root) / name)


def _generate(folder: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[VOCAB["a"]]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6)
    return out[0].tolist()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    run_distributed(save, 2, str(root))
    return root


def test_export_generates_up_to_the_tokenizer_eos(saved: Path, tmp_path: Path) -> None:
    from nxd_trainer.hf import export_hf

    out = export_hf(saved / "right", tmp_path / "hf", tokenizer=tokenizer())
    config = json.loads((out / "config.json").read_text())
    assert (config["use_cache"], config["eos_token_id"], config["pad_token_id"]) == (True, 5, 0)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS
    assert _generate(out) == [3, 4, EOS]


def test_an_export_whose_eos_is_not_the_tokenizers_is_refused(saved: Path, tmp_path: Path) -> None:
    from nxd_trainer.hf import export_hf

    with pytest.raises(ValueError, match=r"eos_token_id is 2 but .*'<\|endoftext\|>' is id 5"):
        export_hf(saved / "wrong", tmp_path / "refused", tokenizer=tokenizer())
    # What it would have done: Llama's default EOS (2) never comes, generation runs on.
    wrong = export_hf(saved / "wrong", tmp_path / "as-saved", config=None, tokenizer=None)
    assert _generate(wrong) == [3, 4, 5, 6, 7, 8, 9]
    fixed = export_hf(
        saved / "wrong", tmp_path / "fixed", tokenizer=tokenizer(), token_ids={"eos_token_id": EOS}
    )
    assert _generate(fixed) == [3, 4, EOS]


def test_architectures_are_filled_for_checkpoints_saved_without_them(
    saved: Path, tmp_path: Path
) -> None:
    import shutil

    from nxd_trainer.hf import export_hf

    old = tmp_path / "old"
    shutil.copytree(saved / "right", old)
    index = json.loads((old / "index.json").read_text())
    del index["hf_config"]["architectures"]
    (old / "index.json").write_text(json.dumps(index))
    out = export_hf(old, tmp_path / "hf", tokenizer=tokenizer())
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
