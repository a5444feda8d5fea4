"""NxD's NxDPPModel attributes and options, and Hugging Face layers kept as module calls.

Parity checks compare against the same model in one process: fp32, summation order differs
(per-microbatch gradients summed, mean of microbatch means), so rtol 1e-5 / atol 1e-6 (round-
off only; gradients are O(1e-2..1)). Checkpointed and plain pipelined runs do the same ops on
the same values (the recompute repeats the forward exactly), so they are compared bit for bit.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import nxd_state
from nxd_pipeline import NxDPPModel
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import load_sibling, run_distributed

MODELS = load_sibling(__file__, "_models")

TOL = {"rtol": 1e-5, "atol": 1e-6}
M = 2


def _grads(model: NxDPPModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None}


def _hf_llama(schedule: str, checkpointed: bool, **kwargs: Any) -> tuple[dict, int, NxDPPModel]:
    """PP=2 over a 4-layer Llama through torch.export; with ``checkpointed``, every local
    decoder layer's forward runs under torch.utils.checkpoint. Returns the gradients, how
    often the layers' forwards ran, and the model."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    reference = MODELS.tiny_llama()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    model = NxDPPModel(
        copy.deepcopy(reference),
        tracer_cls="hf",
        input_names=["input_ids", "labels"],
        num_microbatches=M,
        pipeline_cuts=["model.layers.1"],
        schedule=schedule,
        **kwargs,
    )
    layers = [m for _, m in model.local_named_modules() if isinstance(m, LlamaDecoderLayer)]
    calls = {"n": 0}
    for layer in layers:
        forward = layer.forward

        def counted(*args: Any, forward: Any = forward, **kw: Any) -> Any:
            calls["n"] += 1
            return forward(*args, **kw)

        layer.forward = (
            functools.partial(checkpoint, counted, use_reentrant=False) if checkpointed else counted
        )
    loss = model.run_train(input_ids=ids, labels=ids)
    ref_loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    if loss is not None:
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    expected = dict(reference.named_parameters())
    grads = _grads(model)
    assert len(grads) == len(list(model.local_parameters()))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name].grad, **TOL, msg=f"{schedule}: {name}")
    assert len(layers) == 2  # 4 layers, 2 per stage, each a real module called by the stage
    return grads, calls["n"], model


def hf_layer_checks() -> dict[str, Any]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    out: dict[str, Any] = {}
    for schedule in ("1f1b", "zb_h1"):
        plain, plain_calls, model = _hf_llama(schedule, checkpointed=False)
        again, ckpt_calls, _ = _hf_llama(schedule, checkpointed=True)
        # Each local layer ran once per microbatch, and once more in the recompute. ZB-H1's
        # W replays each weight group in its own autograd call, and non-reentrant
        # checkpointing recomputes once per call: more recomputes (README, limits).
        assert plain_calls == 2 * M, plain_calls
        if schedule == "1f1b":
            assert ckpt_calls == 2 * plain_calls, (plain_calls, ckpt_calls)
        else:
            assert ckpt_calls >= 2 * plain_calls, (plain_calls, ckpt_calls)
        out[f"{schedule} layer forwards, checkpointed"] = ckpt_calls
        assert plain.keys() == again.keys()
        for name in plain:
            torch.testing.assert_close(again[name], plain[name], rtol=0, atol=0, msg=name)
        out[schedule] = len(plain)
    # The stage graph calls the layers (and, named by class, the final norm) as modules.
    model = NxDPPModel(
        MODELS.tiny_llama(),
        tracer_cls="hf",
        input_names=["input_ids", "labels"],
        num_microbatches=M,
        pipeline_cuts=["model.layers.1"],
        leaf_module_cls=["LlamaRMSNorm"],
    )
    calls = [
        str(n.target)
        for stage in model.stages.values()
        for n in stage.graph.nodes
        if n.op == "call_module"
    ]
    rank = nxd_state.get_parallel_state().pipeline_parallel_rank
    wanted = [["model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3"]][rank]
    wanted += ["model.norm"] if rank == 1 else []
    assert [c for c in calls if c != "_guards_fn"] == wanted, calls
    assert model.transformer_layer_cls.__name__ == "LlamaDecoderLayer"
    out["module calls"] = len(calls)
    return out


def test_hf_layers_are_module_calls_that_activation_checkpointing_wraps() -> None:
    for rank, result in enumerate(run_distributed(hf_layer_checks, 2)):
        assert all(n > 0 for n in result.values()), (rank, result)


def _model_wrapper_defers_materialisation() -> int:
    """use_model_wrapper=True: the local parameters stay on meta until the wrapper calls
    move_model_to_device() (NxD's order); then training equals the reference."""
    reference = MODELS.tiny_llama(2)
    with torch.no_grad():
        for module in reference.modules():
            MODELS.llama_init(module)
    with torch.device("meta"):
        lazy = type(reference)(reference.config)
    model = NxDPPModel(
        lazy,
        tracer_cls="hf",
        input_names=["input_ids", "labels"],
        num_microbatches=M,
        pipeline_cuts=["model.layers.0"],
        param_init_fn=MODELS.llama_init,
        use_model_wrapper=True,
    )
    assert all(p.is_meta for p in model.local_parameters())
    model.move_model_to_device()
    assert not any(p.is_meta for p in model.local_parameters())
    held = {name for name, p in lazy.named_parameters() if not p.is_meta}
    assert held == {name for name, _ in model.local_named_parameters()}
    ids = torch.randint(0, 64, (2, 8))
    model.run_train(input_ids=ids, labels=ids)
    reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    expected = dict(reference.named_parameters())
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, **TOL, msg=name)
    return len(held)


def _state_dicts_and_attributes() -> int:
    torch.manual_seed(0)
    reference = TinyGPT(layers=4, tie_embeddings=True)
    given = copy.deepcopy(reference)
    model = NxDPPModel(
        given, transformer_layer_cls="Block", num_microbatches=M, pipeline_cuts=["h.1"]
    )
    assert model.original_torch_module is given
    assert model.transformer_layer_cls is Block
    local = {id(p) for p in model.local_parameters()}
    assert {id(p) for p in model.parameters()} == local  # the original is no submodule
    with torch.no_grad():
        for param in model.local_parameters():
            param.zero_()
    full = reference.state_dict()
    result = model.load_state_dict(full)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    values = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param, values[name], rtol=0, atol=0, msg=name)
    # A checkpoint holding the tied weight once (as safetensors exports do) loads on the
    # last rank too, through the weight's other name.
    model.load_state_dict({k: v for k, v in full.items() if k != "lm_head.weight"})
    # strict: a local key missing is an error naming it; otherwise it is reported.
    own = sorted(model.local_state_dict())
    dropped = {k: v for k, v in full.items() if k != own[0]}
    with pytest.raises(RuntimeError, match=rf"\['{own[0]}'\]"):
        model.load_state_dict(dropped)
    assert model.load_state_dict(dropped, strict=False).missing_keys == [own[0]]
    # Llama: the rotary table is a local buffer under its original name, left out of the
    # state dict as the model itself leaves it out (non-persistent).
    llama = MODELS.tiny_llama(2)
    pipelined = NxDPPModel(
        copy.deepcopy(llama),
        tracer_cls="hf",
        input_names=["input_ids", "labels"],
        num_microbatches=M,
        pipeline_cuts=["model.layers.0"],
    )
    buffers = dict(pipelined.local_named_buffers())
    assert "model.rotary_emb.inv_freq" in buffers  # both stages recompute the rotary table
    torch.testing.assert_close(
        buffers["model.rotary_emb.inv_freq"], llama.model.rotary_emb.inv_freq
    )
    assert set(dict(pipelined.local_named_buffers(prefix="m."))) == {f"m.{k}" for k in buffers}
    assert set(pipelined.local_state_dict()) <= set(llama.state_dict())
    # The stages keep it non-persistent too: state_dict() of the wrapper (its stages, under
    # stages.<s>.) holds no rotary table, as the model's holds none.
    assert not [k for k in pipelined.state_dict() if k.endswith("inv_freq")]
    assert [k for k, _ in pipelined.named_buffers() if k.endswith("inv_freq")]
    # NxD forwards what the wrapper lacks to the original model: config, its methods.
    assert pipelined.config is pipelined.original_torch_module.config
    assert pipelined.get_input_embeddings() is pipelined.original_torch_module.model.embed_tokens
    with pytest.raises(AttributeError, match="no_such_attribute"):
        pipelined.no_such_attribute  # noqa: B018
    assert pipelined.load_state_dict(llama.state_dict()).missing_keys == []
    return len(own)


def api_checks() -> dict[str, int]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    return {
        "use_model_wrapper": _model_wrapper_defers_materialisation(),
        "state dicts": _state_dicts_and_attributes(),
    }


def test_nxd_attributes_state_dicts_and_model_wrapper() -> None:
    for rank, result in enumerate(run_distributed(api_checks, 2)):
        assert all(n > 0 for n in result.values()), (rank, result)
