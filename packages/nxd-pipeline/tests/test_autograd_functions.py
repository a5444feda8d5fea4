"""Custom autograd Functions survive capture: modules applying them run as module calls.

A Function whose backward is not the derivative of its forward (nxd's TP collectives:
identity forward, all-reduce backward) loses that backward when its forward is traced into a
graph. Here a stand-in with the same shape, ``y = x`` forward and ``dL/dx = 3 dL/dy``
backward, shows it in one process: every gradient upstream of it is 3x when it runs, 1x when
it was traced away.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxd_pipeline import PipelineTraceError, capture_graph, partition_graph
from nxd_pipeline._partition import build_stage_module
from nxd_state.testing import load_sibling

MODELS = load_sibling(__file__, "_models")

# fp32, the same operations in the same order in the model and in its stages: only autograd's
# accumulation order may differ (round-off). A lost backward is off by a factor of 3.
TOL = {"rtol": 1e-5, "atol": 1e-6}


class _TimesThreeBackward(torch.autograd.Function):
    """y = x; dL/dx = 3 dL/dy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 3 * grad


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TimesThreeBackward.apply(x)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class _Net(nn.Module):
    """embed -> layer -> the Function (in ``scale``, twice, or in forward itself) -> head."""

    def __init__(self, where: str = "module") -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layer = _Layer()
        self.scale = _Scale()
        self.head = nn.Linear(8, 16)
        self.where = where

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.layer(self.embed(input_ids))
        if self.where in ("module", "twice"):
            h = self.scale(h)
        if self.where == "twice":
            h = self.scale(h)
        if self.where == "root":
            h = _TimesThreeBackward.apply(h)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _run_stages(captured, model: nn.Module, cuts: list[str], ids: torch.Tensor) -> torch.Tensor:
    plan = partition_graph(captured, model, cuts, num_stages=len(cuts) + 1)
    inputs = {"input_ids": ids, "labels": ids}
    received: tuple = ()
    output: Any = None
    for stage in range(plan.num_stages):
        module = build_stage_module(plan, model, stage)
        output = module(*received, *(inputs[n] for n in module.input_names))
        received = tuple(output) if stage < plan.num_stages - 1 else ()
    return output if isinstance(output, torch.Tensor) else output[0]  # export: a flat tuple


def _assert_equal_to(reference: nn.Module, model: nn.Module, loss, expected) -> None:
    torch.testing.assert_close(loss, expected, **TOL)
    loss.backward()
    expected.backward()
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, ref.grad, **TOL, msg=name)


@pytest.mark.parametrize("tracer_cls", ["torch", "hf"])
@pytest.mark.parametrize("where", ["module", "twice"])
def test_a_module_applying_a_function_stays_a_call(tracer_cls: str, where: str) -> None:
    torch.manual_seed(0)
    reference = _Net(where)
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 16, (2, 5))
    if tracer_cls == "hf" and where == "twice":
        # torch.export can keep a module as a call only if it is called once: it cannot be
        # kept, and inlined its backward would be lost, so the capture refuses.
        with pytest.raises(PipelineTraceError, match=r"'scale' \(_Scale\) applies "):
            capture_graph(model, tracer_cls=tracer_cls, leaf_module_cls=[_Layer])
        return
    captured = capture_graph(model, tracer_cls=tracer_cls, leaf_module_cls=[_Layer])
    assert "scale" in captured.module_calls
    assert captured.fixed_inputs == {}  # forward takes no use_cache: none is passed
    loss = _run_stages(captured, model, ["layer"], ids)
    _assert_equal_to(reference, model, loss, reference(ids, ids))


def test_the_stand_in_shows_a_lost_backward() -> None:
    # What the capture prevents: exported as is, the Function's backward is gone and the
    # gradients upstream of it are a third of the model's (so the checks above can fail).
    torch.manual_seed(0)
    reference = _Net()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 16, (2, 5))
    inlined = torch.export.export(model, (ids, ids), strict=False).module()
    inlined(ids, ids).backward()
    reference(ids, ids).backward()
    grad, expected = model.embed.weight.grad, reference.embed.weight.grad
    assert grad is not None
    assert expected is not None
    torch.testing.assert_close(3 * grad, expected, **TOL)


@pytest.mark.parametrize("tracer_cls", ["torch", "hf"])
def test_a_function_in_the_root_forward_is_an_error(tracer_cls: str) -> None:
    with pytest.raises(PipelineTraceError, match=r"the root's forward \(_Net\) applies "):
        capture_graph(_Net("root"), tracer_cls=tracer_cls, leaf_module_cls=[_Layer])


def test_a_cut_inside_a_module_call_names_the_call() -> None:
    model = _Net()
    captured = capture_graph(model, leaf_module_cls=[_Layer])
    with pytest.raises(ValueError, match=r"'layer.linear' falls inside module 'layer'"):
        partition_graph(captured, model, ["layer.linear"], num_stages=2)


def test_autowrap_obj_methods_records_a_method_as_one_call() -> None:
    torch.manual_seed(0)
    reference = MODELS.RoutedNet()
    model = copy.deepcopy(reference)
    with pytest.raises(PipelineTraceError, match="could not trace module 'router'"):
        capture_graph(model)
    # NxD's form: {object: [method names]}; the method runs eagerly in the stage.
    captured = capture_graph(model, autowrap_obj_methods={model.router: ["route"]})
    calls = [n for n in captured.graph_module.graph.nodes if n.op == "call_function"]
    assert any(getattr(n.target, "__name__", "") == "route" for n in calls)
    assert "route" not in vars(model.router)  # the class's method is back
    ids = torch.randint(0, 16, (2, 5))
    loss = _run_stages(captured, model, ["router"], ids)
    _assert_equal_to(reference, model, loss, reference(ids, ids))
    with pytest.raises(ValueError, match=r"a Router has no method 'rout'"):
        capture_graph(model, autowrap_obj_methods={model.router: ["rout"]})
    with pytest.raises(TypeError, match=r"list of method names; got 'route'"):
        capture_graph(model, autowrap_obj_methods={model.router: "route"})


def test_autowrap_obj_methods_is_for_fx_only(caplog: pytest.LogCaptureFixture) -> None:
    model = MODELS.RoutedNet()
    # torch.export refuses route()'s data-dependent branch too.
    with caplog.at_level("WARNING"), pytest.raises(PipelineTraceError):
        capture_graph(model, tracer_cls="hf", autowrap_obj_methods={model.router: ["route"]})
    assert "autowrap_obj_methods applies to torch.fx tracing" in caplog.text
