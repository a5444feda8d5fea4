"""NxD's ``pipeline_config`` dict maps onto :class:`nxd_pipeline.PipelineOptions`: every key
onto the field of its name (``PipelineConfig.options``), and ``initialize_parallel_model``
builds the same pipeline model as NxD's keyword call ``NxDPPModel(module, **kwargs)``.

The two models of the last check are built from the same deterministic weights and run the
same step on the same data under the same schedule, so they must agree bit for bit
(torch.equal): the route to the options is the only difference (DP = 1: the trainer's DP
average divides by 1).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nxd_pipeline import PipelineOptions
from nxd_state.testing import load_sibling, run_distributed
from nxd_trainer import PipelineConfig
from nxd_trainer.testing import Block, Embed, Head

R = load_sibling(__file__, "_recipe")


def _init(module: torch.nn.Module) -> None:
    del module


class _Holder:
    def helper(self) -> int:
        return 1


HOLDER = _Holder()

# Every key of NxD's dict, each set away from its default where that is allowed.
NXD_DICT: dict[str, Any] = {
    "transformer_layer_cls": "Block",
    "num_microbatches": 4,
    "output_loss_value_spec": (True, False),
    "return_mb_loss": True,
    "broadcast_and_average_loss": False,
    "pipeline_cuts": ["blocks.0", "blocks.1", "blocks.2"],
    "input_names": ["input_ids", "labels"],
    "leaf_module_cls": ["Embed", Head],
    "autowrap_functions": [math.sqrt],
    "autowrap_modules": [math],
    "tracer_cls": "torch",
    "param_init_fn": _init,
    "trace_file_path": "graph.txt",
    "use_zero1_optimizer": True,
    "use_model_wrapper": True,
    "use_optimizer_wrapper": True,
    "auto_partition": False,
    "virtual_pipeline_size": 2,
    "schedule": "interleaved_1f1b",
    "async_sends": True,
    "return_loss_on_cpu": True,
    "deallocate_pipeline_outputs": True,
    "fuse_microbatches": True,
    "autowrap_obj_methods": {HOLDER: ["helper"]},
    "_fused_send_recv": True,
}


def test_every_key_maps_onto_the_option_of_its_name() -> None:
    """The section's options equal NxD's keyword call with the dict's values; the keywords
    ``options`` takes are the resolved ones (classes, tracer, initialiser, device ...)."""
    section = PipelineConfig.from_nxd(NXD_DICT)
    assert section is not None
    device = torch.device("cpu")
    options = section.options(
        transformer_layer_cls=Block,
        leaf_module_cls=(Embed, Head),
        input_names=["input_ids", "labels"],
        tracer_cls="torch",
        param_init_fn=_init,
        use_zero1_optimizer=True,
        device=device,
    )
    # NxD's keyword call as initialize_parallel_model makes it: the wrapper flags,
    # return_loss_on_cpu and deallocate_pipeline_outputs are the trainer's, not passed.
    expected = PipelineOptions.from_nxd(
        transformer_layer_cls=Block,
        num_microbatches=4,
        output_loss_value_spec=(True, False),
        return_mb_loss=True,
        broadcast_and_average_loss=False,
        pipeline_cuts=["blocks.0", "blocks.1", "blocks.2"],
        input_names=["input_ids", "labels"],
        leaf_module_cls=[Embed, Head],
        autowrap_functions=(math.sqrt,),
        autowrap_modules=(math,),
        tracer_cls="torch",
        param_init_fn=_init,
        trace_file_path="graph.txt",
        use_zero1_optimizer=True,
        auto_partition=False,
        virtual_pipeline_size=2,
        schedule="interleaved_1f1b",
        device=device,
        async_sends=True,
        fuse_microbatches=True,
        autowrap_obj_methods={HOLDER: ["helper"]},
        _fused_send_recv=True,
    )
    assert options == expected
    assert options.loss_on_cpu is False  # fuse_microbatches: NxD's rule, in both forms


def test_defaults_map_onto_nxdppmodels_defaults() -> None:
    section = PipelineConfig.from_nxd({"pipeline_cuts": ["blocks.1"]})
    assert section is not None
    options = section.options(
        transformer_layer_cls=None,
        leaf_module_cls=(),
        input_names=None,
        tracer_cls=None,
        param_init_fn=None,
        use_zero1_optimizer=False,
        device=torch.device("cpu"),
    )
    assert options == PipelineOptions(
        pipeline_cuts=["blocks.1"],
        leaf_module_cls=[],
        autowrap_functions=(),
        autowrap_modules=(),
        device=torch.device("cpu"),
    )


PIPELINE = {
    "transformer_layer_cls": Block,
    "num_microbatches": 2,
    "pipeline_cuts": ["blocks.1"],
    "leaf_module_cls": ["Embed", "Head"],
    "schedule": "zb_h1",
}


def _same_model_both_ways() -> dict[str, Any]:
    import nxd_state
    import nxd_trainer as nxd
    from nxd_pipeline import NxDPPModel

    config = nxd.neuronx_distributed_config(
        pipeline_parallel_size=2,
        pipeline_config=PIPELINE,
        optimizer_config={"zero_one_enabled": False, "grad_clipping": False},
    )
    by_dict = nxd.initialize_parallel_model(config, R.get_model)
    # NxD's keyword form, as initialize_parallel_model would call it for this dict
    by_kwargs = NxDPPModel(
        R.get_model(),
        transformer_layer_cls=Block,
        num_microbatches=2,
        pipeline_cuts=["blocks.1"],
        leaf_module_cls=[Embed, Head],
        autowrap_functions=(),
        autowrap_modules=(),
        use_zero1_optimizer=True,  # the optimizer wrapper, or NxDModel, averages over DP
        schedule="zb_h1",
        device=nxd_state.current_device(),
    )
    pipeline = by_dict.module
    assert pipeline.options == by_kwargs.options
    assert list(pipeline.stages) == list(by_kwargs.stages)
    assert pipeline.schedule.actions == by_kwargs.schedule.actions
    names = [n for n, _ in by_kwargs.local_named_parameters()]
    assert names == [n for n, _ in pipeline.local_named_parameters()]
    ids = R.batches()[0]
    losses = [by_dict.run_train(input_ids=ids, labels=ids)]
    losses.append(by_kwargs.run_train(input_ids=ids, labels=ids))
    if losses[1] is not None:  # the last stage
        assert torch.equal(losses[0], losses[1])
    grads = [dict(m.local_named_parameters()) for m in (pipeline, by_kwargs)]
    for name in names:
        assert torch.equal(grads[0][name].grad, grads[1][name].grad), name
    nxd_state.destroy_model_parallel()
    return {"stages": list(pipeline.stages), "params": len(names), "loss": losses[1]}


def test_the_dict_and_nxds_keywords_build_the_same_model() -> None:
    results = run_distributed(_same_model_both_ways, 2)
    assert [r["stages"] for r in results] == [["0"], ["1"]]
    assert all(r["params"] > 0 for r in results)
    assert results[0]["loss"] is None
    assert results[1]["loss"] is not None
