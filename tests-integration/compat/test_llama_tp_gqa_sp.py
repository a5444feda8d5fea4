"""An NxD-style tiny Llama (GQA, sequence parallelism, parallel cross entropy) equals one process.

The model is written as NxD's Llama example writes it (see ``_nxd_llama.py``), imported only
through ``neuronx_distributed``. At TP=2 (2 KV heads, one per rank) and TP=4 (2 KV heads,
``kv_size_multiplier=2``), with sequence parallelism (``[s, b, h]`` activations) and without,
two SGD steps run in parallel and on the plain-torch reference holding the same weights; the
loss of each step and every gradient (each rank's shard against its share of the reference
gradient, so all shards together cover the whole model) must agree. Sequence-parallel norm
gradients are summed over TP by ``allreduce_sequence_parallel_gradients(optimizer)``, NxD's call.

Tolerance: both sides run float32; the TP run sums the same products in another order (row-
parallel partial sums, all-reduce/reduce-scatter, the vocab-parallel log-sum-exp) and the two
rotary implementations round differently, so results agree to a few float32 ulps of the
activations: rtol 1e-5, atol 1e-6 (measured max abs error ~1e-7 on gradients of order 1e-2;
a wrong shard, head order or missing reduction is off by the gradient itself).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from nxd_state.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring
STEPS, LR = 2, 0.5


def _llama_module():
    """``_nxd_llama.py``, loaded by path (this folder is not a package)."""
    name = "nxd_compat_tests_llama"
    if name not in sys.modules:
        path = Path(__file__).with_name("_nxd_llama.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _batch(config) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 8 with a padding token inside and ignored (-100) label positions."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, config.vocab_size, (2, 8), generator=gen)
    ids[0, 5] = config.pad_token_id  # looks up the zeroed padding row (no gradient)
    labels = ids.clone()
    labels[1, :3] = -100
    return ids, labels


def _train_and_compare(config, tp: int) -> dict[str, float]:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.grads import allreduce_sequence_parallel_gradients
    from neuronx_distributed.parallel_layers.random import model_parallel_xla_manual_seed

    m = _llama_module()
    rank = parallel_state.get_tensor_model_parallel_rank()
    model_parallel_xla_manual_seed(1234)
    model = m.NxDTinyLlama(config)
    ref = m.reference_from(model)
    # The padding row is zero in the parallel table, as NxD builds it.
    assert not ref.embed_tokens.weight[config.pad_token_id].any()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=LR)
    ids, labels = _batch(config)
    worst, losses = 0.0, []
    for step in range(STEPS):
        loss = model(ids, labels)
        loss.backward()
        if config.sequence_parallel_enabled:
            allreduce_sequence_parallel_gradients(optimizer)
        ref_loss = ref(ids, labels)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda e, s=step: f"loss {s}: {e}")
        expected = m.expected_local_grads(model, ref, rank, tp)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert sorted(grads) == sorted(expected), sorted(set(grads) ^ set(expected))
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, expected[name], **TOL, msg=lambda e, n=name, s=step: f"step {s} {n}: {e}"
            )
            worst = max(worst, float((grad - expected[name]).abs().max()))
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "worst": worst}


def llama_parity(tp: int, kv_size_multiplier: int) -> dict[str, dict[str, float]]:
    from neuronx_distributed.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    m = _llama_module()
    results = {}
    for sp in (True, False):
        config = m.TinyLlamaConfig(
            kv_shared_group_size=kv_size_multiplier, sequence_parallel_enabled=sp
        )
        results[f"sp={sp}"] = _train_and_compare(config, tp)
    return results


@pytest.mark.parametrize(("tp", "kv_size_multiplier"), [(2, 1), (4, 2)])
def test_nxd_style_llama_matches_one_process(tp: int, kv_size_multiplier: int) -> None:
    results = run_distributed(llama_parity, tp, tp, kv_size_multiplier)
    for variant in ("sp=True", "sp=False"):
        losses = [r[variant]["losses"] for r in results]
        assert all(step == losses[0] for step in losses), losses  # one TP-reduced loss
        assert losses[0][1] < losses[0][0], losses[0]  # the SGD step on the shards trained
