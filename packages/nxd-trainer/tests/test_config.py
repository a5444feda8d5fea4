"""The config without processes: NxD's defaults, the dict round trip, and every bad input the
config can see (unknown keys with a suggestion, contradictions, impossible degrees)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from nxd_lora import LoraConfig
from nxd_trainer import (
    MixedPrecisionConfig,
    ModelInitConfig,
    NxDConfig,
    OptimizerConfig,
    PipelineConfig,
)
from nxd_trainer.config import _with_move_factor
from nxd_trainer.testing import Block, CoreAttention


def test_defaults_are_nxds() -> None:
    d = NxDConfig().to_nxd()
    assert (d["tensor_parallel_size"], d["pipeline_parallel_size"]) == (1, 1)
    assert (d["pipeline_config"], d["lora_config"]) == (None, None)
    assert d["activation_checkpoint_config"] is None
    assert (d["pad_model"], d["sequence_parallel"]) == (False, False)
    opt = d["optimizer_config"]
    assert (opt["zero_one_enabled"], opt["grad_clipping"], opt["max_grad_norm"]) == (
        False,
        True,
        1.0,
    )
    assert d["model_init_config"] == {
        "sequential_move_factor": 11,
        "meta_device_init": False,
        "param_init_fn": None,
    }
    # NxD: master weights and fp32 accumulation follow zero_one_enabled unless set.
    assert d["mixed_precision_config"] == {
        "use_master_weights": False,
        "use_fp32_grad_acc": False,
        "use_master_weights_in_ckpt": False,
    }
    zero1 = NxDConfig(optimizer_config={"zero_one_enabled": True}).mixed_precision_config
    assert (zero1.use_master_weights, zero1.use_fp32_grad_acc) == (True, True)
    explicit = NxDConfig(
        optimizer_config={"zero_one_enabled": True},
        mixed_precision_config={"use_fp32_grad_acc": False},
    ).mixed_precision_config
    assert (explicit.use_master_weights, explicit.use_fp32_grad_acc) == (True, False)


def test_optimizer_sections_are_nxd_optims_classes() -> None:
    import nxd_optim
    import nxd_trainer
    from nxd_trainer import sections

    # One class per concept: nxd-trainer re-exports nxd-optim's, it does not define its own.
    assert nxd_trainer.OptimizerConfig is nxd_optim.OptimizerConfig
    assert nxd_trainer.MixedPrecisionConfig is nxd_optim.MixedPrecisionConfig
    assert sections.OptimizerConfig is nxd_optim.OptimizerConfig
    assert sections.MixedPrecisionConfig is nxd_optim.MixedPrecisionConfig
    # NxDConfig takes the instances as NxD's dicts, keeps the optimizer section itself and
    # resolves the mixed-precision one against ZeRO-1 (given values kept).
    optimizer = OptimizerConfig(zero_one_enabled=True, max_grad_norm=0.5)
    config = NxDConfig(
        optimizer_config=optimizer,
        mixed_precision_config=MixedPrecisionConfig(use_fp32_grad_acc=False),
    )
    assert config.optimizer_config is optimizer
    mixed = config.mixed_precision_config
    assert (mixed.use_master_weights, mixed.use_fp32_grad_acc) == (True, False)
    assert NxDConfig.from_nxd(config.to_nxd()) == config


def test_dict_round_trip_keeps_every_setting() -> None:
    def init(module: torch.nn.Module) -> None:
        pass

    config = NxDConfig(
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_config={
            "transformer_layer_cls": Block,
            "num_microbatches": 4,
            "pipeline_cuts": ["blocks.1"],
            "input_names": ["input_ids", "labels"],
            "leaf_module_cls": ["Embed", "Head"],
            "use_optimizer_wrapper": True,
            "trace_file_path": None,
        },
        optimizer_config={"zero_one_enabled": True, "max_grad_norm": 0.5},
        activation_checkpoint_config=[CoreAttention],
        sequence_parallel=True,
        model_init_config={"meta_device_init": True, "param_init_fn": init},
    )
    d = config.to_nxd()
    assert d["pipeline_config"]["num_microbatches"] == 4  # scripts index NxD's dict
    again = NxDConfig.from_nxd(d)
    assert again.to_nxd() == d
    assert again.param_init_fn is init
    assert isinstance(again.pipeline_config, PipelineConfig)
    assert isinstance(again.optimizer_config, OptimizerConfig)
    assert isinstance(again.model_init_config, ModelInitConfig)
    assert isinstance(again.mixed_precision_config, MixedPrecisionConfig)
    lora = NxDConfig(tensor_parallel_size=2, lora_config=LoraConfig(lora_rank=4))
    assert NxDConfig.from_nxd(lora.to_nxd()).lora_config == lora.lora_config
    assert lora.lora_enabled  # any given LoraConfig applies, as in NxD (no enable_lora gate)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        # unknown keys: named, with the closest valid key
        (
            {"optimizer_config": {"zero_one_enable": True}},
            ValueError,
            r"unknown optimizer_config key 'zero_one_enable' \(did you mean 'zero_one_enabled'",
        ),
        (
            {"model_init_config": {"meta_device": True}},
            ValueError,
            r"'meta_device' \(did you mean 'meta_device_init'",
        ),
        (
            {"mixed_precision_config": {"use_master_weight": True}},
            ValueError,
            r"did you mean 'use_master_weights'",
        ),
        (
            {"pipeline_config": {"num_microbatch": 2}},
            ValueError,
            r"'num_microbatch' \(did you mean 'num_microbatches'",
        ),
        (
            {"activation_checkpoint_config": "Full"},
            ValueError,
            r"got 'Full' \(did you mean 'full'",
        ),
        ({"pipeline_config": {"schedule": "1fb1"}}, ValueError, r"did you mean '1f1b'"),
        # wrong types and values
        ({"optimizer_config": [("zero_one_enabled", True)]}, TypeError, "must be a dict"),
        (
            {"optimizer_config": {"zero_one_enabled": 2}},
            TypeError,
            r"must be a bool \(or the int 0 or 1\), got 2",
        ),
        ({"optimizer_config": {"max_grad_norm": -1.0}}, ValueError, "must be a positive number"),
        ({"optimizer_config": {"max_grad_norm": math.nan}}, ValueError, "a positive number"),
        ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size'] must be a positive"),
        ({"pipeline_parallel_size": 1.5}, ValueError, "pipeline_parallel_size'] must be"),
        (
            {"model_init_config": {"sequential_move_factor": 33}},
            ValueError,
            r"in \[1, 32\]",
        ),
        ({"activation_checkpoint_config": Block(8, 2, False, False, 0.0)}, TypeError, "classes"),
        ({"lora_config": {"enable_lora": True}}, TypeError, "nxd_lora.LoraConfig"),
        ({"expert_parallel_size": 0}, ValueError, "expert_parallel_size'] must be a positive"),
        (
            {"expert_parallel_size": 2, "context_parallel_size": 2},
            ValueError,
            "expert_parallel_size=2 with context_parallel_size=2 is not supported yet",
        ),
        # the bad inputs the config can see
        (
            {"model_init_config": {"meta_device_init": True}},
            ValueError,
            r"meta_device_init'\] is True but no 'param_init_fn'",
        ),
        (
            {"sequence_parallel": True},
            ValueError,
            "sequence_parallel=True needs tensor_parallel_size > 1",
        ),
        ({"pipeline_parallel_size": 2}, ValueError, "needs pipeline_config"),
        (
            {"pipeline_parallel_size": 2, "pipeline_config": {"num_microbatches": 2}},
            ValueError,
            r"2 stages need pipeline_config\['pipeline_cuts'\]",
        ),
        (
            {
                "pipeline_parallel_size": 2,
                "pipeline_config": {"pipeline_cuts": ["blocks.0", "blocks.1"]},
            },
            ValueError,
            "has 2 cuts",
        ),
        (
            {"pipeline_parallel_size": 2, "pipeline_config": {"auto_partition": True}},
            ValueError,
            "give 'transformer_layer_cls'",
        ),
        # contradictions
        (
            {
                "optimizer_config": {"zero_one_enabled": True},
                "pipeline_config": {"use_zero1_optimizer": False},
            },
            ValueError,
            r"use_zero1_optimizer'\]=False contradicts",
        ),
        (
            {"mixed_precision_config": {"use_master_weights_in_ckpt": True}},
            ValueError,
            "no master weights to save",
        ),
        (
            {
                "pipeline_config": {"param_init_fn": lambda m: None},
                "model_init_config": {"param_init_fn": lambda m: None},
            },
            ValueError,
            "different functions",
        ),
        (
            {"pipeline_config": {"return_mb_loss": True, "broadcast_and_average_loss": True}},
            ValueError,
            "exclusive",
        ),
        ({"pipeline_config": {"use_model_wrapper": False}}, ValueError, "always wraps"),
        (
            {
                "pipeline_parallel_size": 2,
                "pipeline_config": {"pipeline_cuts": ["blocks.1"]},
                "lora_config": LoraConfig(enable_lora=True),
            },
            ValueError,
            "lora_config with pipeline_parallel_size=2 is not supported yet",
        ),
        (
            {"pipeline_parallel_size": 2, "pad_model": True},
            ValueError,
            "pipeline_parallel_size=1 only",
        ),
    ],
)
def test_bad_config_names_the_key(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        NxDConfig(**kwargs)


def test_top_level_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"'tensor_paralel_size' \(did you mean"):
        NxDConfig.from_nxd({"tensor_paralel_size": 2})
    with pytest.raises(TypeError, match="dict returned by neuronx_distributed_config"):
        NxDConfig.from_nxd([("tensor_parallel_size", 2)])  # type: ignore[arg-type]


def test_degrees_must_divide_the_world() -> None:
    config = NxDConfig(tensor_parallel_size=3)
    with pytest.raises(ValueError, match=re.escape("= 3 does not divide world_size(8)")):
        config.check_world(8)
    assert config.check_world(6).data_parallel_size == 2
    experts = NxDConfig(tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ValueError, match=re.escape("expert_model_parallel_size(2) does not")):
        experts.check_world(6)  # DP = 3
    assert experts.check_world(8).expert_data_parallel_size == 2
    assert NxDConfig.from_nxd(experts.to_nxd()).expert_parallel_size == 2


def test_nxds_newer_keywords() -> None:
    """context_parallel_size / lnc_size are kept in NxD's dict; sequential_move_factor fills
    model_init_config as NxD does (the section's own value wins when the keyword is left at
    its default)."""
    d = NxDConfig(context_parallel_size=1, lnc_size=2).to_nxd()
    assert (d["context_parallel_size"], d["lnc_size"]) == (1, 2)
    assert NxDConfig.from_nxd(d).lnc_size == 2
    cp = NxDConfig(context_parallel_size=4, context_parallel_algorithm="all_to_all")
    assert cp.to_nxd()["context_parallel_algorithm"] == "all_to_all"
    assert NxDConfig.from_nxd(cp.to_nxd()).context_parallel_size == 4
    cp_pp = NxDConfig(  # CP x PP (the stages' inputs: context_parallel.pipeline_input_names)
        context_parallel_size=4,
        pipeline_parallel_size=2,
        pipeline_config={"pipeline_cuts": ["layers.0"], "input_names": ["input_ids", "labels"]},
    )
    assert NxDConfig.from_nxd(cp_pp.to_nxd()).context_parallel_size == 4
    with pytest.raises(ValueError, match=r"input_names'\] must hold 'labels'"):
        NxDConfig(
            context_parallel_size=4,
            pipeline_parallel_size=2,
            pipeline_config={"pipeline_cuts": ["layers.0"], "input_names": ["input_ids"]},
        )
    sp_cp_pp = NxDConfig(  # refused before the double sequence split was fixed
        tensor_parallel_size=2,
        sequence_parallel=True,
        context_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_config={"pipeline_cuts": ["layers.0"], "input_names": ["labels"]},
    )
    assert sp_cp_pp.sequence_parallel
    ep_pp = NxDConfig(
        expert_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_config={"pipeline_cuts": ["layers.0"]},
    )
    assert ep_pp.check_world(4).expert_model_parallel_size == 2
    fill = _with_move_factor(None, 3)
    assert ModelInitConfig.from_nxd(fill).sequential_move_factor == 3
    assert _with_move_factor({"meta_device_init": False}, 5)["sequential_move_factor"] == 5
    assert _with_move_factor({"sequential_move_factor": 2}, 11) == {"sequential_move_factor": 2}
    same = ModelInitConfig(sequential_move_factor=6)
    assert _with_move_factor(same, 6) is same
    with pytest.raises(ValueError, match=r"sequential_move_factor=6 contradicts"):
        _with_move_factor(ModelInitConfig(sequential_move_factor=2), 6)


def test_config_without_a_launcher_creates_no_process_group(monkeypatch) -> None:
    """NxD builds no groups when torch.distributed is not initialised (a Lightning script
    makes its config before the Trainer starts the processes); nor does nxd without a
    launcher. initialize_parallel_model builds them later."""
    import nxd_state
    from nxd_trainer import initialize_parallel_model, neuronx_distributed_config

    assert not torch.distributed.is_initialized()
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = neuronx_distributed_config(tensor_parallel_size=1, sequential_move_factor=2)
    assert not torch.distributed.is_initialized()
    assert not nxd_state.model_parallel_is_initialized()
    assert config["model_init_config"]["sequential_move_factor"] == 2
    try:
        model = initialize_parallel_model(config, lambda: torch.nn.Linear(2, 2))
        assert torch.distributed.get_world_size() == 1
        assert nxd_state.get_parallel_state().data_parallel_size == 1
        assert isinstance(model.module, torch.nn.Linear)
    finally:
        nxd_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
