"""Bad input fails with a clear error on every rank, and no rank is left hanging.

Config errors (degrees that do not fit the world, PP without cuts, meta init without
``param_init_fn``, sequence parallel without TP, unknown keys) are raised before any process
group is built or any collective runs. Errors of the model (``model_fn`` returning a
non-module, a Hugging Face model at PP > 1 without ``input_names``, sequence-parallel layers
without the setting ...) are raised on every rank; a ``model_fn`` failing on one rank only
makes the others raise too (one 4-byte failure flag is exchanged), instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nxd_state.testing import run_distributed


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def _fails_on_rank_one() -> torch.nn.Module:
    from nxd_trainer.testing import TinyLM

    if torch.distributed.get_rank() == 1:
        raise OSError("checkpoint file missing on this node")
    return TinyLM()


def _config_cases() -> dict[str, tuple[dict[str, Any], type, str]]:
    return {
        "degrees": (
            {"tensor_parallel_size": 3},
            ValueError,
            "tensor_parallel_size(3) x pipeline_parallel_size(1) = 3 does not divide world_size(2)",
        ),
        "pp without cuts": (
            {"pipeline_parallel_size": 2, "pipeline_config": {"num_microbatches": 2}},
            ValueError,
            "need pipeline_config['pipeline_cuts']",
        ),
        "meta without init": (
            {"model_init_config": {"meta_device_init": True}},
            ValueError,
            "no 'param_init_fn'",
        ),
        "sp without tp": ({"sequence_parallel": True}, ValueError, "needs tensor_parallel_size"),
        "unknown key": (
            {"optimizer_config": {"zero1": True}},
            ValueError,
            "unknown optimizer_config key 'zero1'",
        ),
        "unknown argument": (
            {"tensor_parallel": 2},
            TypeError,
            "'tensor_parallel' (did you mean 'tensor_parallel_size'?)",
        ),
        "context parallelism with pp, no labels": (
            {
                "context_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "pipeline_config": {"pipeline_cuts": ["l.0"], "input_names": ["input_ids"]},
            },
            ValueError,
            "pipeline_config['input_names'] must hold 'labels', got ['input_ids']",
        ),
        "context-parallel algorithm": (
            {"context_parallel_size": 2, "context_parallel_algorithm": "all-to-al"},
            ValueError,
            "context_parallel_algorithm must be one of ('ring', 'all_to_all'), got 'all-to-al'",
        ),
        "two move factors": (
            {"sequential_move_factor": 4, "model_init_config": {"sequential_move_factor": 8}},
            ValueError,
            "sequential_move_factor=4 contradicts model_init_config['sequential_move_factor']=8",
        ),
        "bad lnc_size": ({"lnc_size": 0}, ValueError, "'lnc_size'] must be a positive integer"),
    }


def _model_cases() -> dict[str, tuple[dict[str, Any], Callable[[], Any], type, str]]:
    from nxd_trainer.testing import TinyLM

    def not_a_module() -> Any:
        return {"weights": torch.zeros(2)}

    return {
        "model_fn returns a dict": ({}, not_a_module, TypeError, "must return a torch.nn.Module"),
        "hf at pp2 without input_names": (
            {"pipeline_parallel_size": 2, "pipeline_config": {"pipeline_cuts": ["model.layers.0"]}},
            _tiny_llama,
            ValueError,
            "pipeline_config['input_names'] is required",
        ),
        "sp config, plain model": (
            {"tensor_parallel_size": 2, "sequence_parallel": True},
            lambda: TinyLM(tensor_parallel=True),
            ValueError,
            "no layer of the model was built with sequence_parallel_enabled",
        ),
        "sp model, no sp config": (
            {"tensor_parallel_size": 2},
            lambda: TinyLM(tensor_parallel=True, sequence_parallel=True),
            ValueError,
            "set sequence_parallel=True",
        ),
        "full checkpointing, unknown layers": (
            {"activation_checkpoint_config": "full"},
            TinyLM,
            ValueError,
            "give pipeline_config['transformer_layer_cls']",
        ),
        "pad_model without heads": (
            {"pad_model": True},
            lambda: torch.nn.Linear(4, 4),
            ValueError,
            "config.num_attention_heads",
        ),
        "cp, plain model": (
            {"context_parallel_size": 2},
            TinyLM,
            ValueError,
            "context_parallel_size=2 needs a Hugging Face causal LM",
        ),
        "one rank fails": ({}, _fails_on_rank_one, Exception, ""),
    }


def _catch(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return "no error", ""


def every_rank_reports() -> dict[str, Any]:
    import nxd_state
    import nxd_trainer as nxd

    out: dict[str, Any] = {}
    for name, (kwargs, _, _) in _config_cases().items():
        nxd_state.destroy_model_parallel()
        with nxd_state.count_collectives() as counter:
            out[name] = _catch(lambda kwargs=kwargs: nxd.neuronx_distributed_config(**kwargs))
        # before any collective, and before any process group was built
        out[name] += (counter.as_dict(), nxd_state.model_parallel_is_initialized())
    for name, (kwargs, model_fn, _, _) in _model_cases().items():
        nxd_state.destroy_model_parallel()
        config = nxd.neuronx_distributed_config(**kwargs)
        out[name] = _catch(lambda c=config, f=model_fn: nxd.initialize_parallel_model(c, f))
    nxd_state.destroy_model_parallel()
    config = nxd.neuronx_distributed_config()
    out["optimizer class"] = _catch(
        lambda: nxd.initialize_parallel_optimizer(config, torch.nn.Linear, [torch.zeros(1)])
    )
    out["config for other degrees"] = _catch(
        lambda: nxd.initialize_parallel_model({**config, "tensor_parallel_size": 2}, lambda: None)
    )
    return out


def test_bad_inputs_raise_on_every_rank() -> None:
    results = run_distributed(every_rank_reports, 2)
    for name, (_, error, message) in _config_cases().items():
        for rank, out in enumerate(results):
            kind, text, traffic, initialized = out[name]
            assert kind == error.__name__, (name, rank, kind, text)
            assert message in text, (name, rank, text)
            assert traffic == {}, (name, rank, traffic)
            assert initialized is False, (name, rank)
    for name, (_, _, error, message) in _model_cases().items():
        for rank, out in enumerate(results):
            kind, text = out[name]
            if name == "one rank fails":
                expected = ("OSError", "missing") if rank == 1 else ("RuntimeError", "another rank")
                assert (kind, expected[1] in text) == (expected[0], True), (rank, kind, text)
                continue
            assert kind == error.__name__, (name, rank, kind, text)
            assert message in text, (name, rank, text)
    for out in results:
        assert out["optimizer class"][0] == "TypeError"
        assert "torch.optim.Optimizer subclass" in out["optimizer class"][1]
        assert out["config for other degrees"][0] == "ValueError"
        assert "tensor_parallel_size=2" in out["config for other degrees"][1]
