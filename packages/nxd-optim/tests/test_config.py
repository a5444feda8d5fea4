"""NxD's ``optimizer_config`` / ``mixed_precision_config`` dicts map onto OptimizerConfig and
MixedPrecisionConfig without loss; NxD's defaults resolve against ZeRO-1; bad values, unknown
keys and contradictions fail naming the value and what was expected; the optimizer applies
exactly what the config resolves to."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import nn

import nxd_state
from nxd_optim import (
    MixedPrecisionConfig,
    NeuronZero1Optimizer,
    NxDOptimizer,
    OptimizerConfig,
    build_optimizer,
)
from nxd_state.testing import run_distributed

# Every key of NxD's dicts (and nxd's two additions), each at a value other than its default.
OPTIMIZER = {
    "zero_one_enabled": True,
    "grad_clipping": False,
    "max_grad_norm": 0.5,
    "norm_type": math.inf,
    "bucket_cap_mb": 4.0,
}
MIXED = {"use_master_weights": True, "use_fp32_grad_acc": False, "use_master_weights_in_ckpt": True}


def test_every_key_maps_onto_a_field_and_back() -> None:
    assert {f.name for f in dataclasses.fields(OptimizerConfig)} == set(OPTIMIZER)
    assert {f.name for f in dataclasses.fields(MixedPrecisionConfig)} == set(MIXED)
    optimizer = OptimizerConfig.from_nxd(OPTIMIZER)
    mixed = MixedPrecisionConfig.from_nxd(MIXED)
    assert dataclasses.asdict(optimizer) == OPTIMIZER
    assert dataclasses.asdict(mixed) == MIXED
    assert OptimizerConfig.from_nxd(optimizer) is optimizer  # an instance is itself
    assert MixedPrecisionConfig.from_nxd(mixed) is mixed
    assert OptimizerConfig.from_nxd(None) == OptimizerConfig()
    # NxD's documented default dict.
    assert dataclasses.asdict(OptimizerConfig()) == {
        "zero_one_enabled": False,
        "grad_clipping": True,
        "max_grad_norm": 1.0,
        "norm_type": 2.0,
        "bucket_cap_mb": 25.0,
    }
    # NxD's scripts pass 0 / 1 for flags: read as bools, not kept as ints.
    flags = OptimizerConfig.from_nxd({"zero_one_enabled": 1, "grad_clipping": 0})
    assert (flags.zero_one_enabled, flags.grad_clipping) == (True, False)
    assert MixedPrecisionConfig(use_fp32_grad_acc=0).use_fp32_grad_acc is False  # type: ignore[arg-type]


@pytest.mark.parametrize("zero1", [False, True])
def test_mixed_precision_defaults_follow_zero1(zero1: bool) -> None:
    resolved = MixedPrecisionConfig().resolved(zero1)
    assert (resolved.use_master_weights, resolved.use_fp32_grad_acc) == (zero1, zero1)
    assert (resolved.master_weights, resolved.fp32_grad_acc) == (zero1, zero1)
    assert resolved.use_master_weights_in_ckpt is False
    given = MixedPrecisionConfig(use_master_weights=not zero1, use_fp32_grad_acc=not zero1)
    kept = given.resolved(zero1)  # given values win over the defaults
    assert (kept.use_master_weights, kept.use_fp32_grad_acc) == (not zero1, not zero1)
    assert kept is not given  # resolved() copies
    with pytest.raises(ValueError, match=r"'use_master_weights'\] is None .*resolved"):
        _ = MixedPrecisionConfig().master_weights


def test_contradictions_are_refused() -> None:
    no_masters = r"'use_master_weights_in_ckpt'\] is True but 'use_master_weights' is False"
    with pytest.raises(ValueError, match=no_masters):  # explicit
        MixedPrecisionConfig(use_master_weights=False, use_master_weights_in_ckpt=True).resolved(
            True
        )
    with pytest.raises(ValueError, match=no_masters):  # NxD's default without ZeRO-1
        MixedPrecisionConfig(use_master_weights_in_ckpt=True).resolved(False)
    assert MixedPrecisionConfig(use_master_weights_in_ckpt=True).resolved(True).master_weights


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (
            lambda: OptimizerConfig.from_nxd({"zero_one_enable": True}),
            ValueError,
            r"unknown optimizer_config key 'zero_one_enable' \(did you mean 'zero_one_enabled'",
        ),
        (
            lambda: MixedPrecisionConfig.from_nxd({"use_fp32_grad_accum": True, "x": 1}),
            ValueError,
            r"unknown mixed_precision_config keys 'use_fp32_grad_accum' \(did you mean "
            r"'use_fp32_grad_acc'\?\), 'x'; valid keys",
        ),
        (
            lambda: OptimizerConfig.from_nxd([("zero_one_enabled", True)]),
            TypeError,
            r"optimizer_config must be a dict \(or a OptimizerConfig\), got list",
        ),
        (
            lambda: OptimizerConfig(zero_one_enabled="yes"),
            TypeError,
            r"optimizer_config\['zero_one_enabled'\] must be a bool .*got 'yes'",
        ),
        (
            lambda: MixedPrecisionConfig(use_master_weights=2),
            TypeError,
            r"mixed_precision_config\['use_master_weights'\] must be a bool .*got 2",
        ),
        (
            lambda: OptimizerConfig(max_grad_norm=True),
            ValueError,
            r"\['max_grad_norm'\] must be a positive number .*got True",
        ),
        (
            lambda: OptimizerConfig(norm_type=0),
            ValueError,
            r"\['norm_type'\] must be a positive number \(or math.inf\), got 0",
        ),
        (
            lambda: OptimizerConfig(bucket_cap_mb="25"),
            ValueError,
            r"\['bucket_cap_mb'\] must be a positive number, got '25'",
        ),
        (  # the mixed-precision keys do not belong here: the error says where they went
            lambda: OptimizerConfig(zero_one_enabled=True, use_fp32_grad_acc=True),
            TypeError,
            r"\['use_fp32_grad_acc'\]: these are mixed_precision_config keys, held by "
            r"nxd_optim.MixedPrecisionConfig",
        ),
    ],
)
def test_bad_values_name_the_value_and_what_was_expected(
    make: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        make()


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan])
def test_max_grad_norm_must_be_positive_when_clipping(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"\['max_grad_norm'\] must be a positive number .*{bad}"):
        OptimizerConfig(max_grad_norm=bad)
    assert not OptimizerConfig(grad_clipping=False, max_grad_norm=bad).grad_clipping  # unused
    assert OptimizerConfig(max_grad_norm=math.inf).max_grad_norm == math.inf  # measure only


def _built() -> dict[str, Any]:
    """What NxDOptimizer builds from each form of the configs, at DP = 2, bf16 params."""
    nxd_state.initialize_model_parallel()
    out: dict[str, Any] = {}
    for zero1 in (False, True):
        model = nn.Linear(4, 4).to(torch.bfloat16)
        opt = NxDOptimizer(
            model.parameters(), torch.optim.SGD, config=OptimizerConfig(zero_one_enabled=zero1)
        )
        inner = opt.optimizer
        out[f"zero1={zero1}"] = (
            opt.mixed_precision.use_master_weights,
            opt.mixed_precision.use_fp32_grad_acc,
            len(opt.master_weights_by_param()),
            isinstance(inner, NeuronZero1Optimizer) and inner.use_fp32_grad_acc,
        )
    dicts = build_optimizer(
        dict(OPTIMIZER, zero_one_enabled=False),
        torch.optim.SGD,
        nn.Linear(4, 4).to(torch.bfloat16).parameters(),
        mixed_precision_config=MIXED,
        lr=0.1,
    )
    out["dicts"] = (dataclasses.asdict(dicts.config), dataclasses.asdict(dicts.mixed_precision))
    out["masters"] = len(dicts.master_weights_by_param())
    return out


def test_the_optimizer_applies_the_resolved_config() -> None:
    for out in run_distributed(_built, 2):
        # NxD's defaults: no masters and bf16 sums without ZeRO-1; both with it (the ZeRO-1
        # optimizer accumulates in fp32, the disagreement that once gave a wrong result).
        assert out["zero1=False"] == (False, False, 0, False)
        assert out["zero1=True"] == (True, True, 0, True)  # ZeRO-1's masters are flat shards
        assert out["dicts"] == (dict(OPTIMIZER, zero_one_enabled=False), MIXED)
        assert out["masters"] == 2  # weight and bias
