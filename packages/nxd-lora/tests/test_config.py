"""LoraConfig: NxD's fields, validated on creation, translated to and from PEFT's JSON."""

from __future__ import annotations

import pytest

from nxd_lora import LoraConfig


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lora_rank": 0}, ValueError, "lora_rank must be a positive integer, got 0"),
        ({"lora_rank": -3}, ValueError, "got -3"),
        ({"lora_rank": 2.0}, TypeError, "lora_rank must be an int, got 2.0"),
        ({"lora_alpha": 0}, ValueError, "lora_alpha must be positive, got 0"),
        ({"lora_dropout": 1.0}, ValueError, r"lora_dropout must be in \[0, 1\), got 1.0"),
        ({"bias": "some"}, ValueError, r"bias must be one of \('none', 'all', 'lora_only'\)"),
        ({"init_lora_weights": "pissa"}, ValueError, "init_lora_weights must be one of"),
        ({"target_modules": ""}, ValueError, "must not be an empty string"),
        ({"target_modules": []}, ValueError, "at least one module keyword"),
        ({"target_modules": ["q", ""]}, ValueError, "non-empty strings"),
        ({"merge_lora": True}, ValueError, "merge_lora=True needs save_lora_base=True"),
    ],
)
def test_bad_values_raise_naming_the_value(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        LoraConfig(**kwargs)


def test_nxd_defaults_and_keyword_only() -> None:
    config = LoraConfig()
    assert (config.enable_lora, config.lora_rank, config.lora_alpha) == (False, 16, 8.0)
    assert (config.bias, config.init_lora_weights, config.lora_save_dir) == (
        "none",
        "default",
        "lora_adapter",
    )
    assert config.save_lora_config_adapter
    assert not config.save_lora_base
    with pytest.raises(TypeError):
        LoraConfig(True, 16)  # type: ignore[misc]


def test_save_modes() -> None:
    assert LoraConfig().save_mode == "adapter"
    assert LoraConfig(save_lora_base=True).save_mode == "base_and_adapter"
    assert LoraConfig(save_lora_base=True, merge_lora=True).save_mode == "merged"


def test_merge_sharded_lora_saves_the_adapter_only_as_nxd_does() -> None:
    config = LoraConfig(merge_sharded_lora=True, save_lora_base=True, merge_lora=True)
    assert (config.save_lora_base, config.merge_lora) == (False, False)
    assert config.save_mode == "adapter"
    assert not LoraConfig().merge_sharded_lora


def test_get_lora_model_wraps_whenever_a_config_is_given() -> None:
    """NxD's current ``get_lora_model`` does not consult ``enable_lora``: a config without the
    flag wraps (before the fix it returned the model unchanged), and so does an explicit
    False."""
    from torch import nn

    from nxd_lora import LoRAModel, LoraModel, get_lora_model

    assert LoRAModel is LoraModel
    model = nn.Sequential(nn.Linear(4, 4))
    assert get_lora_model(model, None) is model
    wrapped = get_lora_model(model, LoraConfig(target_modules=["0"]))
    assert isinstance(wrapped, LoraModel)
    assert wrapped.module is model
    with pytest.raises(ValueError, match="already is a LoraModel"):
        get_lora_model(wrapped, LoraConfig(target_modules=["0"]))
    off = get_lora_model(
        nn.Sequential(nn.Linear(4, 4)), LoraConfig(enable_lora=0, target_modules=["0"])
    )
    assert isinstance(off, LoraModel)
    assert off.lora_config.enable_lora is False  # NxD's int flag, kept as a bool


def test_peft_round_trip_and_unsupported_peft_options() -> None:
    config = LoraConfig(
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.1,
        bias="lora_only",
        target_modules=["q_proj", "v_proj"],
        use_rslora=True,
        init_lora_weights="gaussian",
        modules_to_save=["lm_head"],
    )
    peft_dict = config.to_peft_dict()
    assert (peft_dict["r"], peft_dict["init_lora_weights"], peft_dict["peft_type"]) == (
        8,
        "gaussian",
        "LORA",
    )
    assert LoraConfig.from_peft_dict(peft_dict).mismatches(config) == []
    other = LoraConfig(lora_rank=4, lora_alpha=16, target_modules=["v_proj", "q_proj"])
    assert [m.split(":")[0] for m in other.mismatches(config)] == [
        "lora_rank",
        "lora_dropout",
        "bias",
        "use_rslora",
        "init_lora_weights",
        "modules_to_save",
    ]
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        LoraConfig.from_peft_dict({**peft_dict, "use_dora": True})
    regex = LoraConfig.from_peft_dict({**peft_dict, "target_modules": ".*proj"})
    assert regex.target_modules == ".*proj"  # PEFT's regex form is NxD's too
    with pytest.raises(ValueError, match="unknown fields"):
        config.with_saved_fields({"lora_rnak": 3})


def test_version_matches_distribution_metadata() -> None:
    import importlib.metadata

    import nxd_lora

    assert nxd_lora.__version__ == importlib.metadata.version("nxd-lora")
