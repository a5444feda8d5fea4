"""NxD's NxDPPModel arguments beyond the documented ones, in one process (no process group).

NxD's ``_debug_mode`` partitions the model as pipeline rank ``_debug_pp_rank`` of
``_debug_pp_size`` without any process group, so each check below builds the wrappers of every
debug rank around one model and chains their stages by hand: that must equal the model itself,
loss and every gradient. Tolerance: fp32, the same operations in the same order; only
autograd's accumulation order may differ (round-off): rtol 1e-5, atol 1e-6 (a missing or
doubled gradient is off by O(1e-2) or more).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from torch import nn

from nxd_pipeline import NxDPPModel
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import load_sibling

MODELS = load_sibling(__file__, "_models")

TOL = {"rtol": 1e-5, "atol": 1e-6}

# NxD's own parameter order (pipeline/model.py), as far as positional calls can reach.
NXD_ORDER = [
    "module",
    "transformer_layer_cls",
    "num_microbatches",
    "virtual_pipeline_size",
    "output_loss_value_spec",
    "return_mb_loss",
    "broadcast_and_average_loss",
    "use_zero1_optimizer",
    "use_model_wrapper",
    "use_optimizer_wrapper",
    "pipeline_cuts",
    "input_names",
    "leaf_module_cls",
    "autowrap_functions",
    "autowrap_modules",
    "autowrap_obj_methods",
    "tracer_cls",
    "param_init_fn",
    "trace_file_path",
    "return_loss_on_cpu",
    "deallocate_pipeline_outputs",
    "auto_partition",
    "fuse_microbatches",
    "manual_pp_partition",
    "manual_pp_stage_partition_fn",
    "manual_pp_loss_fn",
]


def _debug_ranks(model: nn.Module, size: int, *args: Any, **kwargs: Any) -> list[NxDPPModel]:
    return [
        NxDPPModel(model, *args, _debug_mode=True, _debug_pp_size=size, _debug_pp_rank=r, **kwargs)
        for r in range(size)
    ]


def _chain(wrappers: list[NxDPPModel], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every stage of every debug rank, in stage order, fed by hand."""
    stages = {int(s): m for w in wrappers for s, m in w.stages.items()}
    received: tuple = ()
    output: Any = None
    for index in sorted(stages):
        stage = stages[index]
        output = stage(*received, *(inputs[n] for n in stage.input_names))
        received = tuple(output) if index < len(stages) - 1 else ()
    return output


def _assert_same_training(reference: nn.Module, model: nn.Module, loss, expected) -> None:
    torch.testing.assert_close(loss, expected, **TOL)
    loss.backward()
    expected.backward()
    named = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, named[name].grad, **TOL, msg=name)


def test_signature_follows_nxds_positional_order() -> None:
    names = list(inspect.signature(NxDPPModel.__init__).parameters)[1:]  # without self
    assert names[: len(NXD_ORDER)] == NXD_ORDER
    for name in ("_debug_mode", "_debug_pp_size", "_debug_pp_rank"):
        kind = inspect.signature(NxDPPModel.__init__).parameters[name].kind
        assert kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("v", [1, 2])
def test_debug_mode_partitions_without_process_groups(v: int) -> None:
    torch.manual_seed(0)
    reference = TinyGPT(layers=4)
    model = copy.deepcopy(reference)
    cuts = ["h.1"] if v == 1 else ["h.0", "h.1", "h.2"]
    # NxD's positional call: (module, transformer_layer_cls, num_microbatches,
    # virtual_pipeline_size); v = 2 interleaves: rank r holds stages r and r + 2.
    wrappers = _debug_ranks(model, 2, Block, 2, v, pipeline_cuts=cuts)
    assert [sorted(int(s) for s in w.stages) for w in wrappers] == [
        list(range(r, 2 * v, 2)) for r in range(2)
    ]
    assert [w.pipeline_parallel_rank for w in wrappers] == [0, 1]
    assert all(w.virtual_pipeline_size == v for w in wrappers)
    assert wrappers[0].schedule.name == ("1f1b" if v == 1 else "interleaved_1f1b")
    ids = torch.randint(0, 64, (4, 8))
    loss = _chain(wrappers, {"input_ids": ids, "labels": ids})
    _assert_same_training(reference, model, loss, reference(ids, ids))
    with pytest.raises(RuntimeError, match=r"_debug_mode=True .* pipeline rank 1's stages of 2"):
        wrappers[1].run_train(input_ids=ids, labels=ids)


@pytest.mark.parametrize(
    ("size", "rank"), [(2, 2), (0, 0), (2, -1), (2, "0")], ids=["rank", "size", "neg", "str"]
)
def test_debug_mode_rejects_a_rank_outside_the_size(size: Any, rank: Any) -> None:
    with pytest.raises(ValueError, match=rf"_debug_pp_size={size!r}, _debug_pp_rank={rank!r}"):
        NxDPPModel(
            TinyGPT(),
            Block,
            pipeline_cuts=["h.1"],
            _debug_mode=True,
            _debug_pp_size=size,
            _debug_pp_rank=rank,
        )


def test_virtual_pipeline_size_is_checked() -> None:
    with pytest.raises(ValueError, match=r"virtual_pipeline_size must be a positive int, got 0"):
        NxDPPModel(TinyGPT(), Block, 2, 0, pipeline_cuts=["h.1"], _debug_mode=True)


def test_fuse_microbatches_returns_the_loss_on_the_device_as_nxd() -> None:
    (wrapper,) = _debug_ranks(TinyGPT(), 1, Block, fuse_microbatches=True)
    assert wrapper.return_loss_on_cpu is False
    (plain,) = _debug_ranks(TinyGPT(), 1, Block, deallocate_pipeline_outputs=True)
    assert plain.return_loss_on_cpu is True


def test_autowrap_obj_methods_reaches_the_tracer() -> None:
    torch.manual_seed(0)
    reference = MODELS.RoutedNet()
    model = copy.deepcopy(reference)
    # NxD's form {object: [method names]}: route() is recorded as one call and runs eagerly.
    wrappers = _debug_ranks(
        model,
        2,
        pipeline_cuts=["router"],
        input_names=["input_ids", "labels"],
        autowrap_obj_methods={model.router: ["route"]},
    )
    ids = torch.randint(0, 16, (2, 5))
    loss = _chain(wrappers, {"input_ids": ids, "labels": ids})
    _assert_same_training(reference, model, loss, reference(ids, ids))
