"""★ Hugging Face export and import with a tiny Llama trained at TP=2 x PP=2.

A random 2-layer GQA Llama (saved with ``save_pretrained``; no download) gets its projections
swapped for nxd's column/row-parallel layers, is cut into 2 pipeline stages, trains 2 AdamW
steps on 4 gloo ranks and is checkpointed. Every parameter trains, the replicated ones
(embeddings, norms, head) included: their TP copies stay equal only if the pipeline's capture
keeps the column layers' backward all-reduce (the checkpoint stores one copy of each, so a
divergent copy would show up as a loss or logits mismatch below). The checkpoint holds
exactly the Hugging Face model's state (the stages keep ``rotary_emb.inv_freq``
non-persistent). Then:

* ``export_hf`` writes a folder that ``transformers.AutoModelForCausalLM.from_pretrained``
  loads; its loss equals the pipelined nxd model's eval loss, and its logits equal those of
  a TP=2 nxd model that loaded the same checkpoint (resharded from TP=2 x PP=2);
* the exported folder, loaded straight into a TP=2 nxd model (``load_hf_checkpoint``, each
  rank reading its slices), gives the same logits again; a small ``max_shard_size`` writes
  several shards plus ``model.safetensors.index.json``, which load the same.

Tolerance: fp32; TP splits each projection's reduction into two partial sums and the
pipeline averages micro-batch losses, so results agree to fp32 reassociation of O(1) values
through 2 layers: rtol 1e-5, atol 1e-5 (a wrong or transposed shard is off by O(1)).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_ckpt.hf import HF_INDEX_NAME, export_hf, load_hf_checkpoint
from nxd_ckpt.testing import tensor_parallel_llama
from nxd_state.testing import add_preload, run_distributed

add_preload("transformers.models.llama.modeling_llama")

TOL = {"rtol": 1e-5, "atol": 1e-5}  # see the module docstring
VOCAB = 96


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    path = tmp_path / "base"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(3))


def train_pipelined(base: str, ckpt: str) -> float:
    import nxd_state
    from nxd_optim import build_optimizer
    from nxd_pipeline import NxDPPModel

    nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    model = NxDPPModel(
        tensor_parallel_llama(base),
        num_microbatches=2,
        pipeline_cuts=["model.layers.0"],
        input_names=["input_ids", "labels"],
        tracer_cls="hf",
        broadcast_and_average_loss=True,
    )
    optimizer = build_optimizer(
        {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0},
        torch.optim.AdamW,
        list(model.local_parameters()),
        lr=1e-2,
    )
    ids = _batch()
    for _ in range(2):
        model.run_train(input_ids=ids, labels=ids)
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(ckpt, "trained", model=model, optimizer=optimizer)
    return float(model.run_eval(input_ids=ids, labels=ids))


def tp2_logits(base: str, ckpt: str | None, hf: str | None) -> torch.Tensor:
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = tensor_parallel_llama(base).eval()  # the untrained weights until loaded
    if ckpt is not None:
        load_checkpoint(ckpt, "trained", model=model)
    if hf is not None:
        load_hf_checkpoint(model, hf)
    with torch.no_grad():
        return model(input_ids=_batch()).logits


def test_export_of_a_tp2_pp2_llama_loads_in_transformers(tmp_path: Path, llama_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import nxd_ckpt

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    losses = run_distributed(train_pipelined, 4, str(llama_dir), str(ckpt))
    assert len(set(losses)) == 1  # every rank evaluates the same model
    saved = set(nxd_ckpt.read_index(ckpt / "trained").tensors["model"])
    expected = set(AutoModelForCausalLM.from_pretrained(llama_dir).state_dict())
    assert saved == expected
    config = AutoConfig.from_pretrained(llama_dir)
    export_hf(ckpt, out, tag="trained", config=config)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        result = theirs(input_ids=_batch(), labels=_batch())
    torch.testing.assert_close(result.loss, torch.tensor(losses[0]), **TOL)
    untrained = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        before = untrained(input_ids=_batch()).logits
    assert (result.logits - before).abs().max() > 1e-2  # training moved the weights

    resharded = run_distributed(tp2_logits, 2, str(llama_dir), str(ckpt), None)
    for logits in resharded:
        torch.testing.assert_close(logits, result.logits, **TOL)

    imported = run_distributed(tp2_logits, 2, str(llama_dir), None, str(out))
    for logits in imported:
        torch.testing.assert_close(logits, result.logits, **TOL)

    sharded = tmp_path / "hf-sharded"
    export_hf(ckpt, sharded, tag="trained", config=config, max_shard_size="20KB")
    weight_map = json.loads((sharded / HF_INDEX_NAME).read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 2
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    again = AutoModelForCausalLM.from_pretrained(sharded).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=_batch()).logits, result.logits, **TOL)


def test_export_needs_a_config(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "t", model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="pass config="):
        export_hf(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="max_shard_size '5 apples'"):
        export_hf(tmp_path, tmp_path / "out", config={}, max_shard_size="5 apples")


def test_export_name_map_renames_and_drops(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    layer = nn.Linear(3, 2)
    save_checkpoint(tmp_path / "ckpt", "t", model=layer)

    def rename(name: str) -> str | None:
        return None if name == "bias" else f"proj.{name}"

    export_hf(tmp_path / "ckpt", tmp_path / "out", tag="t", config={}, name_map=rename)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert list(exported) == ["proj.weight"]
    assert torch.equal(exported["proj.weight"], layer.weight.detach())
