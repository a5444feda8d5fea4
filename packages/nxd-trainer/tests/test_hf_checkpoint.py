"""Sharded checkpoints of parallelised Hugging Face models and the export back to a Hugging Face
folder, at TP=2: Llama, Qwen2 (tied embeddings, biases) and Mistral (1 KV head: replicated on
both ranks, stored once).

A model trained 2 SGD steps is saved with ``save_model_sharded_checkpoint``; then

* ``export_hf`` writes a folder that ``transformers`` loads unsharded in one process: its
  logits equal the TP model's gathered logits (rtol 1e-5 / atol 1e-5: TP splits the matmul
  sums; O(1) logits);
* a fresh parallelised model loads it with ``load_model_sharded_checkpoint`` and another with
  ``parallelize(checkpoint_dir=...)``: logits equal the trained model's bitwise (same shards,
  same computation).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
FAMILIES = ("llama", "qwen2", "mistral")
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return H.full_logits(model(input_ids=H.batch(seed=3)).logits, vocab)


def save_and_reload(root: str) -> dict[str, Any]:
    import nxd_state
    from nxd_state import collectives
    from nxd_trainer.hf import ParallelizersManager, export_hf

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    for family in FAMILIES:
        reference = H.model(family)
        vocab = reference.config.vocab_size
        parallelizer = ParallelizersManager.parallelizer_for_model(reference)
        model = parallelizer.parallelize(copy.deepcopy(reference))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(2):
            ids = H.batch(seed=20 + step)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        trained = _logits(model, vocab)
        sharded = Path(root) / family / "sharded"
        parallelizer.save_model_sharded_checkpoint(model, sharded)
        collectives.barrier()
        if nxd_state.get_parallel_state().rank == 0:
            export_hf(sharded, Path(root) / family / "hf")
        collectives.barrier()
        fresh = parallelizer.parallelize(H.model(family, seed=5))
        before = _logits(fresh, vocab)
        parallelizer.load_model_sharded_checkpoint(fresh, sharded)
        direct = parallelizer.parallelize(H.model(family, seed=6), checkpoint_dir=sharded)
        out[family] = {
            "trained": trained,
            "untrained": before,
            "loaded": _logits(fresh, vocab),
            "checkpoint_dir": _logits(direct, vocab),
        }
    return out


def test_sharded_save_load_and_export_round_trip(tmp_path: Path) -> None:
    import transformers

    results = run_distributed(save_and_reload, 2, str(tmp_path))
    for family in FAMILIES:
        for result in results:
            got = result[family]
            assert not torch.equal(got["untrained"], got["trained"])  # the loads matter
            torch.testing.assert_close(got["loaded"], got["trained"], rtol=0, atol=0)
            torch.testing.assert_close(got["checkpoint_dir"], got["trained"], rtol=0, atol=0)
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family / "hf")
        exported.eval()
        with torch.no_grad():
            logits = exported(input_ids=H.batch(seed=3)).logits
        torch.testing.assert_close(logits, results[0][family]["trained"], **TOL)
