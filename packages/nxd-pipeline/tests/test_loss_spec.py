"""``output_loss_value_spec`` picks the loss as NxD does (no processes)."""

from __future__ import annotations

import pytest
import torch

from nxd_pipeline import select_loss
from nxd_pipeline._loss import check_loss_spec

LOSS = torch.tensor(2.5)
LOGITS = torch.ones(2, 3)


def test_bare_true_means_the_output_is_the_loss() -> None:
    assert select_loss(LOSS, True) is LOSS
    with pytest.raises(TypeError, match="marks the output as the loss, but it is a tuple"):
        select_loss((LOSS, LOGITS), True)


def test_tuple_and_dict_specs_nest_and_the_first_true_wins() -> None:
    assert select_loss((LOGITS, LOSS), (False, True)) is LOSS
    assert select_loss((LOGITS, (LOGITS, LOSS)), (False, (False, True))) is LOSS
    other = torch.tensor(7.0)
    assert select_loss((LOSS, other), (True, True)) is LOSS  # NxD: depth first, spec order
    assert select_loss({"loss": LOSS, "logits": LOGITS}, {"loss": True, "logits": False}) is LOSS
    assert select_loss({"aux": {"loss": LOSS}}, {"aux": {"loss": True}}) is LOSS


def test_specs_match_hugging_face_model_outputs() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    output = CausalLMOutputWithPast(loss=LOSS, logits=LOGITS)
    assert select_loss(output, {"loss": True, "logits": False}) is LOSS
    assert select_loss(output, (True, False)) is LOSS  # by position, as output[0]
    assert select_loss(output, None) is LOSS
    # nxd goes further than NxD: keys marked False may be absent (past_key_values is None).
    assert select_loss(output, {"loss": True, "past_key_values": False}) is LOSS


def test_default_finds_the_loss_itself() -> None:
    assert select_loss(LOSS, None) is LOSS
    assert select_loss({"loss": LOSS}, None) is LOSS
    assert select_loss((LOSS, LOGITS), None) is LOSS
    with pytest.raises(TypeError, match="pass output_loss_value_spec"):
        select_loss("text", None)


@pytest.mark.parametrize(
    ("output", "spec", "error", "pattern"),
    [
        ((LOSS,), (False,), ValueError, "marks no value of the output True"),
        ((LOSS,), (True, False), TypeError, r"at least 2 values, got tuple of 1"),
        (LOSS, {"loss": True}, TypeError, "to be a mapping, got Tensor"),
        ({"logits": LOGITS}, {"loss": True}, KeyError, r"only the keys \['logits'\]"),
        ((LOGITS, LOSS), (True, False), TypeError, r"scalar tensor, got \(2, 3\)"),
    ],
)
def test_mismatches_name_the_spec_and_the_output(
    output: object, spec: object, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        select_loss(output, spec)  # type: ignore[arg-type]


def test_specs_that_mark_nothing_fail_at_construction() -> None:
    check_loss_spec(None)
    check_loss_spec(True)
    check_loss_spec((False, {"loss": True}))
    for spec in (False, (False, False), {"loss": False}):
        with pytest.raises(ValueError, match="marks no value True"):
            check_loss_spec(spec)
    with pytest.raises(TypeError, match="entries must be bools"):
        check_loss_spec(("loss",))  # type: ignore[arg-type]
