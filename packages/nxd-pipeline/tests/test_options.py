"""PipelineOptions: each bad value refused with its message, NxD's keyword form mapped onto the
fields, and ``NxDPPModel(module, **nxd_kwargs)`` equal to ``NxDPPModel(module, options=...)``.

The two models of the last check are built from copies of one model and run the same step on
the same data under the same schedule, so they must agree bit for bit (torch.equal): the
options object is the only difference between the two constructions.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import pytest
import torch
from torch import nn

import nxd_state
from nxd_pipeline import NxDPPModel, PipelineOptions
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import run_distributed


def _identity_partition(layers: Any, num_stages: int) -> dict[nn.Module, int]:
    return {layer: 0 for layer in layers}


BAD = [
    ({"num_microbatches": 0}, ValueError, r"num_microbatches must be a positive int, got 0"),
    ({"num_microbatches": "2"}, ValueError, r"num_microbatches must be a positive int, got '2'"),
    (
        {"virtual_pipeline_size": -1},
        ValueError,
        r"virtual_pipeline_size must be a positive int, got -1",
    ),
    (
        {"debug_mode": True, "debug_pp_size": 2, "debug_pp_rank": 2},
        ValueError,
        r"0 <= _debug_pp_rank < _debug_pp_size, got _debug_pp_size=2, _debug_pp_rank=2",
    ),
    (
        {"return_mb_loss": True, "broadcast_and_average_loss": True},
        ValueError,
        r"return_mb_loss=True and broadcast_and_average_loss=True are exclusive",
    ),
    ({"output_loss_value_spec": False}, ValueError, r"output_loss_value_spec=False marks no"),
    (
        {"output_loss_value_spec": (1.5,)},
        TypeError,
        r"output_loss_value_spec entries must be bools, .* got float 1.5",
    ),
    (
        {"auto_partition": True, "pipeline_cuts": ["h.1"]},
        ValueError,
        r"auto_partition=True chooses the cuts itself; got pipeline_cuts=\['h.1'\]",
    ),
    (
        {"manual_pp_partition": True, "pipeline_cuts": ["h.1"]},
        ValueError,
        r"splits the layer list itself, got pipeline_cuts=\['h.1'\], auto_partition=False",
    ),
    ({"pipeline_cuts": "h.1"}, TypeError, r"pipeline_cuts must be a list of names .* got 'h.1'"),
    ({"input_names": ["ids", 3]}, TypeError, r"input_names must be a list of names .*3\]"),
    (
        {"transformer_layer_cls": 3},
        TypeError,
        r"transformer_layer_cls must be a class or a class name, got 3",
    ),
    ({"tracer_cls": "jit"}, ValueError, r"tracer_cls must be 'torch', 'hf', .* got 'jit'"),
    ({"param_init_fn": "zeros"}, TypeError, r"param_init_fn must be callable or None, got"),
    ({"async_sends": "yes"}, TypeError, r"async_sends must be True, False or None, got 'yes'"),
    ({"device": "nowhere"}, ValueError, r"device must be a torch.device .* got 'nowhere'"),
    ({"schedule": "zigzag"}, ValueError, r"unknown pipeline schedule 'zigzag': expected one"),
    (
        {"schedule": "1f1b", "virtual_pipeline_size": 2},
        ValueError,
        r"schedule '1f1b' runs one model chunk per rank, got virtual_pipeline_size=2",
    ),
    (
        {"xla_runtime_options": {"_fused_send_recv": True, "_bogus": 1}},
        TypeError,
        r"xla_runtime_options has unknown keys \['_bogus'\]: expected names from",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[str(k) for k, *_ in BAD])
def test_each_bad_value_is_refused_naming_it(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as raised:
        PipelineOptions(**kwargs)
    assert "\n" not in str(raised.value)  # one line


def test_the_defaults_are_nxds_and_the_options_are_frozen() -> None:
    options = PipelineOptions()
    assert options.num_microbatches == 1
    assert options.return_loss_on_cpu is True
    assert options.schedule_name == "1f1b"
    assert options.loss_on_cpu is True
    assert PipelineOptions(virtual_pipeline_size=2).schedule_name == "interleaved_1f1b"
    fused = PipelineOptions(fuse_microbatches=True)
    assert fused.return_loss_on_cpu is True
    assert fused.loss_on_cpu is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_microbatches = 2  # type: ignore[misc]


def test_from_nxd_binds_nxds_positional_order_and_private_keywords() -> None:
    options = PipelineOptions.from_nxd(
        Block, 4, 2, _debug_mode=True, _debug_pp_size=2, _fused_send_recv=True
    )
    assert options == PipelineOptions(
        transformer_layer_cls=Block,
        num_microbatches=4,
        virtual_pipeline_size=2,
        debug_mode=True,
        debug_pp_size=2,
        xla_runtime_options={"_fused_send_recv": True},
    )
    with pytest.raises(TypeError, match=r"NxDPPModel got unexpected keyword arguments \['bogus'\]"):
        PipelineOptions.from_nxd(bogus=1)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['debug_mode'\\]"):
        PipelineOptions.from_nxd(debug_mode=True)  # NxD spells it _debug_mode
    with pytest.raises(TypeError, match="multiple values for argument 'num_microbatches'"):
        PipelineOptions.from_nxd(Block, 2, num_microbatches=2)
    with pytest.raises(TypeError, match="too many positional arguments"):
        PipelineOptions.from_nxd(*([None] * 26))


def test_every_field_is_one_nxd_keyword_of_the_signature() -> None:
    params = inspect.signature(NxDPPModel).parameters
    names = {f.name for f in dataclasses.fields(PipelineOptions)} - {"xla_runtime_options"}
    nxd = {name: "_" + name for name in ("debug_mode", "debug_pp_size", "debug_pp_rank")}
    assert set(params) == {"module", "options", "xla_runtime_options"} | {
        nxd.get(n, n) for n in names
    }
    for f in dataclasses.fields(PipelineOptions):
        if f.name in names:
            assert params[nxd.get(f.name, f.name)].default == f.default, f.name
    assert params["options"].kind is inspect.Parameter.KEYWORD_ONLY


def test_options_and_nxd_arguments_together_are_refused() -> None:
    options = PipelineOptions(transformer_layer_cls=Block, debug_mode=True, debug_pp_size=1)
    with pytest.raises(TypeError, match=r"not both: got options and num_microbatches"):
        NxDPPModel(TinyGPT(), options=options, num_microbatches=2)
    with pytest.raises(TypeError, match=r"not both: got options and 1 positional argument"):
        NxDPPModel(TinyGPT(), Block, options=options)
    with pytest.raises(TypeError, match=r"options must be a PipelineOptions, got dict"):
        NxDPPModel(TinyGPT(), options={"num_microbatches": 2})  # type: ignore[arg-type]


def test_the_module_must_match_manual_mode() -> None:
    with pytest.raises(TypeError, match="manual_pp_partition=True takes the model as a list"):
        PipelineOptions(manual_pp_partition=True).check_module(TinyGPT())
    with pytest.raises(TypeError, match="a list of layers needs manual_pp_partition=True"):
        PipelineOptions().check_module([nn.Linear(2, 2)])
    PipelineOptions(
        manual_pp_partition=True, manual_pp_stage_partition_fn=_identity_partition
    ).check_module([nn.Linear(2, 2)])


def _same_model_both_ways() -> dict[str, Any]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    reference = TinyGPT(layers=2)
    ids = torch.randint(0, 64, (4, 8))
    # NxD's form, positional as far as NxD's order goes, then keywords
    by_kwargs = NxDPPModel(
        copy.deepcopy(reference), Block, 2, pipeline_cuts=["h.0"], schedule="zb_h1"
    )
    options = PipelineOptions(
        transformer_layer_cls=Block, num_microbatches=2, pipeline_cuts=["h.0"], schedule="zb_h1"
    )
    by_options = NxDPPModel(copy.deepcopy(reference), options=options)
    assert by_kwargs.options == by_options.options == options
    assert list(by_kwargs.stages) == list(by_options.stages)
    assert by_kwargs.schedule.actions == by_options.schedule.actions
    assert by_kwargs.schedule.name == "zb_h1"
    names = [n for n, _ in by_kwargs.local_named_parameters()]
    assert names == [n for n, _ in by_options.local_named_parameters()]
    losses = [m.run_train(input_ids=ids, labels=ids) for m in (by_kwargs, by_options)]
    if losses[0] is not None:  # the last stage
        assert torch.equal(losses[0], losses[1])
    grads = [dict(m.local_named_parameters()) for m in (by_kwargs, by_options)]
    for name in names:
        assert torch.equal(grads[0][name].grad, grads[1][name].grad), name
    nxd_state.destroy_model_parallel()
    return {"stages": list(by_kwargs.stages), "params": len(names), "loss": losses[0]}


def test_nxd_keywords_and_options_build_the_same_model() -> None:
    results = run_distributed(_same_model_both_ways, 2)
    assert [r["stages"] for r in results] == [["0"], ["1"]]
    assert all(r["params"] > 0 for r in results)
    assert results[0]["loss"] is None
    assert results[1]["loss"] is not None
