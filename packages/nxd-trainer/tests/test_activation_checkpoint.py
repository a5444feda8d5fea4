"""Activation checkpointing ("full", selective, None) gives the same loss and gradients as no
checkpointing, with dropout on, at TP=2 and PP=2, and for a Hugging Face model's layers (at
PP=1, and at PP=2 where the pipeline's ``torch.export`` capture keeps them as module calls).

Exactness: a recomputed forward runs the same kernels on the same inputs with the same random
masks, so gradients are bitwise equal (tolerance 0). The masks of dropout inside the TP region
come from the model-parallel RNG stream; recomputing without restoring it (torch's checkpoint
alone) draws other masks, and that case is checked to differ, so the comparison can fail.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from nxd_state.testing import load_sibling, run_distributed, run_named_checks

R = load_sibling(__file__, "_recipe")
EXACT = {"rtol": 0.0, "atol": 0.0}
DROPOUT = 0.2


def _step(
    tp: int, pp: int, checkpoint: Any, patch: Any = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int], dict[str, torch.Tensor]]:
    """One run_train under a fixed seed: (loss, grads, CoreAttention forward calls, tracker
    states after backward)."""
    import nxd_state
    import nxd_trainer as nxd
    from nxd_trainer.testing import Block, CoreAttention

    nxd_state.destroy_model_parallel()
    pipeline = {"transformer_layer_cls": Block}  # "full" checkpoints Block
    if pp > 1:
        pipeline.update(
            num_microbatches=2,
            pipeline_cuts=["blocks.1"],
            leaf_module_cls=["Embed", "Head"],
            broadcast_and_average_loss=True,
        )
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline,
        activation_checkpoint_config=checkpoint,
    )
    model = nxd.initialize_parallel_model(
        config, R.get_model, tensor_parallel=True, dropout=DROPOUT
    )
    if patch is not None:
        patch(model)
    # Count CoreAttention.forward runs (the original forward and any recompute call it).
    names = {id(m): n for n, m in model.named_modules() if isinstance(m, CoreAttention)}
    calls = dict.fromkeys(names.values(), 0)
    original = CoreAttention.forward

    def counting(self: Any, *args: Any) -> Any:
        calls[names[id(self)]] += 1
        return original(self, *args)

    CoreAttention.forward = counting  # type: ignore[method-assign]
    nxd_state.model_parallel_manual_seed(1234)
    ids = R.batches()[0]
    try:
        loss = model.run_train(ids, ids)
    finally:
        CoreAttention.forward = original  # type: ignore[method-assign]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss, grads, calls, nxd_state.get_rng_tracker().get_states()


def _torch_checkpoint_only(model: Any) -> None:
    """CoreAttention recomputed by torch's checkpoint alone (TP-stream state not restored)."""
    from torch.utils.checkpoint import checkpoint

    from nxd_trainer.testing import CoreAttention

    for module in model.modules():
        if isinstance(module, CoreAttention):

            def forward(self: Any, *args: Any) -> Any:
                return checkpoint(type(self).forward, self, *args, use_reentrant=False)

            module.forward = types.MethodType(forward, module)


def _same(a: Any, b: Any, what: str) -> None:
    loss_a, grads_a, _, tracker_a = a
    loss_b, grads_b, _, tracker_b = b
    torch.testing.assert_close(loss_b, loss_a, **EXACT, msg=f"{what}: loss")
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **EXACT, msg=f"{what}: {name}")
    for name in tracker_a:  # recomputation leaves the streams where the forward left them
        assert torch.equal(tracker_a[name], tracker_b[name]), f"{what}: tracker stream {name}"


def check_tp2() -> None:
    from nxd_trainer.testing import CoreAttention

    none = _step(2, 1, None)
    assert all(n == 1 for n in none[2].values())
    full = _step(2, 1, "full")
    _same(none, full, "full")
    assert all(n == 2 for n in full[2].values()), full[2]  # forward, then the recompute
    selective = _step(2, 1, CoreAttention)
    _same(none, selective, "selective")
    assert all(n == 2 for n in selective[2].values()), selective[2]
    plain = _step(2, 1, None, patch=_torch_checkpoint_only)
    differs = [n for n in none[1] if not torch.equal(none[1][n], plain[1][n])]
    assert differs, "recomputing without the RNG tracker should draw other dropout masks"


def check_pp2() -> None:
    from nxd_trainer.testing import CoreAttention

    none = _step(1, 2, None)
    _same(none, _step(1, 2, "full"), "pp full")
    selective = _step(1, 2, [CoreAttention])
    _same(none, selective, "pp selective")
    assert all(n == 2 * 2 for n in selective[2].values())  # 2 micro-batches, each recomputed


def _llama_step(checkpoint: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    import nxd_state
    import nxd_trainer as nxd

    def get_model() -> torch.nn.Module:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_dropout=DROPOUT,
        )
        return LlamaForCausalLM(config)

    nxd_state.destroy_model_parallel()
    config = nxd.neuronx_distributed_config(activation_checkpoint_config=checkpoint)
    model = nxd.initialize_parallel_model(config, get_model)
    if checkpoint == "full":  # the layers named by _no_split_modules
        layers = nxd.checkpointed_modules(model.local_module())
        assert layers == ["model.layers.0", "model.layers.1"]
    torch.manual_seed(7)
    ids = R.batches()[0]
    loss = model.run_train(input_ids=ids, labels=ids)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def check_hf_full() -> None:
    loss, grads = _llama_step(None)
    loss_ckpt, grads_ckpt = _llama_step("full")
    torch.testing.assert_close(loss_ckpt, loss, **EXACT)
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], **EXACT, msg=name)


def _llama_pp_step(
    checkpoint: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str], dict[str, int]]:
    """A 4-layer HF Llama with attention dropout at PP=2 (``torch.export`` capture, 2
    micro-batches): loss, gradients, the checkpointed modules and the decoder layers'
    forward calls."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    import nxd_state
    import nxd_trainer as nxd

    def get_model() -> torch.nn.Module:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, attention_dropout=DROPOUT,
        )  # fmt: skip
        return LlamaForCausalLM(config)

    nxd_state.destroy_model_parallel()
    config = nxd.neuronx_distributed_config(
        pipeline_parallel_size=2,
        pipeline_config={"num_microbatches": 2, "input_names": ["input_ids", "labels"],
                         "tracer_cls": "hf",
                         "auto_partition": True, "broadcast_and_average_loss": True},
        activation_checkpoint_config=checkpoint,
    )  # fmt: skip
    model = nxd.initialize_parallel_model(config, get_model)
    layers = {id(m): n for n, m in model.local_module().named_modules()
              if isinstance(m, modeling_llama.LlamaDecoderLayer)}  # fmt: skip
    calls = dict.fromkeys(layers.values(), 0)
    original = modeling_llama.LlamaDecoderLayer.forward

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[layers[id(self)]] += 1
        return original(self, *args, **kwargs)

    modeling_llama.LlamaDecoderLayer.forward = counting  # type: ignore[method-assign]
    try:
        torch.manual_seed(7)
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
        loss = model.run_train(input_ids=ids, labels=ids)
    finally:
        modeling_llama.LlamaDecoderLayer.forward = original  # type: ignore[method-assign]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss, grads, nxd.checkpointed_modules(model.local_module()), calls


def check_hf_pp2() -> None:
    """Hugging Face layers kept as module calls by the pipeline's capture are checkpointed at
    PP=2 and recomputed in backward: the same loss and gradients bit for bit (dropout masks
    replayed), each local layer run twice per micro-batch with "full", once without."""
    from transformers.models.llama import modeling_llama

    loss, grads, none, calls = _llama_pp_step(None)
    assert none == []
    assert set(calls.values()) == {2}, calls  # each layer once per micro-batch (2)
    for checkpoint in ("full", [modeling_llama.LlamaAttention]):
        loss_ckpt, grads_ckpt, names, calls_ckpt = _llama_pp_step(checkpoint)
        assert len(names) == 2, names  # the 2 local layers, or their 2 attention modules
        torch.testing.assert_close(loss_ckpt, loss, **EXACT)
        for name in grads:
            torch.testing.assert_close(grads_ckpt[name], grads[name], **EXACT, msg=name)
        if checkpoint == "full":  # the recompute calls the layer's forward again
            assert set(calls_ckpt.values()) == {4}, calls_ckpt


def two_rank_checks() -> list[str]:
    return run_named_checks(
        {"tp2": check_tp2, "pp2": check_pp2, "hf full": check_hf_full, "hf pp2": check_hf_pp2}
    )


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    assert run_distributed(two_rank_checks, 2) == [["tp2", "pp2", "hf full", "hf pp2"]] * 2
