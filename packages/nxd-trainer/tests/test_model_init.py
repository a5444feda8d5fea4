"""Meta-device init with ``param_init_fn`` builds the same model as eager init (TP=2, PP=2, in
waves of one rank), holding only this rank's part; and NxDModel's module API is local to the
rank, under the original names.

Exactness: both paths run the same ``deterministic_init`` on the same full shapes and slice
the same way, so parameters, the loss and the gradients are bitwise equal (tolerance 0).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed, run_named_checks

R = load_sibling(__file__, "_recipe")
EXACT = {"rtol": 0.0, "atol": 0.0}
BUILT: list[torch.nn.Module] = []  # the model_fn's models, to inspect what stayed on meta


def get_model_recorded(**kwargs: Any) -> torch.nn.Module:
    from nxd_trainer.testing import TinyLM

    BUILT.append(TinyLM(vocab=R.VOCAB, **kwargs))
    return BUILT[-1]


def init_with_device(module: torch.nn.Module, device: torch.device) -> None:
    """The ``param_init_fn(module, device)`` form."""
    from nxd_trainer.testing import deterministic_init

    assert all(p.device == device for p in module.parameters(recurse=False))
    deterministic_init(module)


def _build(tp: int, pp: int, meta: bool, **config: Any) -> Any:
    import nxd_state
    import nxd_trainer as nxd
    from nxd_trainer.testing import Block

    nxd_state.destroy_model_parallel()
    pipeline = None
    if pp > 1:
        pipeline = {
            "transformer_layer_cls": Block,
            "num_microbatches": 2,
            "pipeline_cuts": ["blocks.1"],
            "leaf_module_cls": ["Embed", "Head"],
            "broadcast_and_average_loss": True,
        }
    init = {"sequential_move_factor": 1}  # one rank at a time: two waves on two ranks
    if meta:
        init.update(meta_device_init=True, param_init_fn=init_with_device)
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline,
        model_init_config=init,
        **config,
    )
    return nxd.initialize_parallel_model(
        nxd_config, get_model_recorded if meta else R.get_model, tensor_parallel=True
    )


def _train_step(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = R.batches()[0]
    loss = model.run_train(ids, ids)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _meta_equals_eager(tp: int, pp: int) -> None:
    eager = _build(tp, pp, meta=False)
    eager_state = {k: v.clone() for k, v in eager.state_dict().items()}
    eager_loss, eager_grads = _train_step(eager)
    BUILT.clear()
    meta = _build(tp, pp, meta=True)
    state = meta.state_dict()
    assert set(state) == set(eager_state)
    for name, value in state.items():
        assert not value.is_meta, name
        torch.testing.assert_close(value, eager_state[name], **EXACT, msg=name)
    loss, grads = _train_step(meta)
    torch.testing.assert_close(loss, eager_loss, **EXACT)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **EXACT, msg=name)
    # Nothing outside this rank's part was ever materialised: the model_fn's model keeps the
    # other stages on the meta device.
    (original,) = BUILT
    local = {n for n, _ in meta.named_parameters()}
    for name, param in original.named_parameters():
        assert param.is_meta == (name not in local), name


def check_meta_tp2() -> None:
    _meta_equals_eager(2, 1)


def check_meta_pp2() -> None:
    _meta_equals_eager(1, 2)


def check_module_api_pp2() -> dict[str, Any]:
    """PP=2: the wrapper's torch.nn.Module API sees this rank's stage, original names."""
    import nxd_state

    model = _build(1, 2, meta=False)
    reference = R.get_model(tensor_parallel=True)
    full_names = {n for n, _ in reference.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    assert names
    assert set(names) < full_names
    assert [p for _, p in model.named_parameters()] == list(model.parameters())
    assert set(model.state_dict()) == set(names)  # TinyLM has no buffers
    assert list(model.named_buffers()) == []
    assert {n for n, _ in model.named_modules()} <= {n for n, _ in reference.named_modules()}
    assert len(list(model.children())) > 0
    assert isinstance(model.local_module(), torch.nn.ModuleDict)
    assert model.local_modules() == list(model.local_module().values())
    assert model.dtype == torch.float32
    # (``config`` itself now resolves at PP > 1: NxDPPModel forwards missing attributes to the
    # original model, as NxD, and TinyLM carries a small ``config``.)
    with pytest.raises(AttributeError, match="no attribute 'no_such', nor has the wrapped TinyLM"):
        _ = model.no_such
    with pytest.raises(RuntimeError, match=r"call model\.run_train"):
        model(R.batches()[0], R.batches()[0])
    # load_state_dict round trip: perturb, reload the saved local state, same again
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    model.load_state_dict(saved)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    with pytest.raises(RuntimeError, match="missing"):
        model.load_state_dict({})
    # run_eval: the eval loss of the whole batch, no gradients, eval mode
    ids = R.batches()[0]
    loss = model.run_eval(input_ids=ids, labels=ids)
    assert not model.training
    with torch.no_grad():
        expected = reference.eval()(ids, ids)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)  # micro-batch means
    assert all(p.grad is None for p in model.parameters())
    return {"names": names, "pp_rank": nxd_state.get_pipeline_model_parallel_rank()}


def check_module_api_tp2() -> None:
    model = _build(2, 1, meta=False)
    reference = R.get_model(tensor_parallel=True)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert list(model.state_dict()) == list(reference.state_dict())
    ids = R.batches()[0]
    torch.testing.assert_close(model(ids, ids), reference(ids, ids), **EXACT)
    loss = model.run_eval(ids, ids)
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    model.train()
    assert all(m.training for m in model.modules())
    torch.testing.assert_close(model.run_train(ids, ids), loss, **EXACT)  # no dropout


def check_hf_passthrough() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import nxd_state
    import nxd_trainer as nxd

    nxd_state.destroy_model_parallel()
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = nxd.initialize_parallel_model(
        nxd.neuronx_distributed_config(), LlamaForCausalLM, False, config
    )
    assert model.config is model.local_module().config
    assert model.dtype == torch.float32
    assert model.name_or_path == ""
    ids = R.batches()[0]
    assert model.run_train(input_ids=ids, labels=ids).requires_grad is False
    assert all(p.grad is not None for p in model.parameters())


def check_hf_pipeline() -> None:
    """A Hugging Face Llama at PP=2 through the trainer (torch.export capture, chosen for HF
    models): loss and every local gradient equal one process (fp32; the pipeline sums two
    micro-batch means: round-off only, rtol 1e-5 / atol 1e-6 as nxd-pipeline's own tests)."""
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
        )
        return LlamaForCausalLM(config)

    nxd_state.destroy_model_parallel()
    nxd_config = nxd.neuronx_distributed_config(
        pipeline_parallel_size=2,
        pipeline_config={
            "num_microbatches": 2,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["model.layers.0"],
            "broadcast_and_average_loss": True,
        },
    )
    model = nxd.initialize_parallel_model(nxd_config, get_model)
    reference = get_model()
    ids = R.batches()[0]
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    loss = model.run_train(input_ids=ids, labels=ids)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss, expected.detach(), **tol)
    grads = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, **tol, msg=name)
    assert model.config is not None  # the HF config passes through at PP > 1 too


def two_rank_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}

    def api_pp2() -> None:
        out["pp2"] = check_module_api_pp2()

    run_named_checks(
        {
            "meta tp2": check_meta_tp2,
            "meta pp2": check_meta_pp2,
            "api pp2": api_pp2,
            "api tp2": check_module_api_tp2,
            "hf": check_hf_passthrough,
            "hf pp2": check_hf_pipeline,
        }
    )
    return out


def test_meta_init_equals_eager_and_the_wrapper_is_local() -> None:
    results = run_distributed(two_rank_checks, 2)
    by_stage = {r["pp2"]["pp_rank"]: set(r["pp2"]["names"]) for r in results}
    assert not by_stage[0] & by_stage[1]  # each parameter on one stage only
    full = {n for n, _ in R.get_model().named_parameters()}
    assert by_stage[0] | by_stage[1] == full
