"""Graph capture and partitioning in one process: stages chained by hand equal the model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from nxd_pipeline import PipelineTraceError, auto_pipeline_cuts, capture_graph, partition_graph
from nxd_pipeline._build import layer_class
from nxd_pipeline._partition import build_stage_module, node_costs
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import load_sibling

MODELS = load_sibling(__file__, "_models")

# fp32 and the same ops in the same order: chaining the stages by hand reproduces the model's
# loss and gradients up to round-off in how autograd sums a gradient's contributions.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _chain(plan, root: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run every stage in order, feeding each the previous stage's outputs."""
    received: tuple = ()
    output = None
    for stage in range(plan.num_stages):
        module = build_stage_module(plan, root, stage)
        output = module(*received, *(inputs[n] for n in module.input_names))
        received = tuple(output) if stage < plan.num_stages - 1 else ()
    return output


def test_fx_partition_of_gpt_keeps_names_and_equals_the_model() -> None:
    torch.manual_seed(0)
    reference = TinyGPT(layers=4)
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 64, (2, 8))
    captured = capture_graph(model, leaf_module_cls=(Block,))
    assert captured.input_names == ["input_ids", "labels"]
    assert [n.target for n in captured.graph_module.graph.nodes if n.op == "call_module"][2:6] == [
        "h.0",
        "h.1",
        "h.2",
        "h.3",
    ]  # transformer layers stay whole (leaves)
    plan = partition_graph(captured, model, ["h.0", "h.2"], num_stages=3)
    names = [sorted(params) for params in plan.stage_parameters]
    assert names[0][:2] == ["h.0.fc.bias", "h.0.fc.weight"]
    assert "wte.weight" in names[0]
    assert "lm_head.weight" in names[2]
    assert not any(n.startswith("h.0.") for n in names[2])
    assert {n for stage in names for n in stage} == {n for n, _ in model.named_parameters()}
    assert plan.stage_parameters[1]["h.1.q_proj.weight"] is model.h[1].q_proj.weight
    assert all(len(values) == 1 for values in plan.crossing)  # only the hidden states cross
    loss = _chain(plan, model, {"input_ids": ids, "labels": ids})
    expected = reference(ids, ids)
    torch.testing.assert_close(loss, expected, **TOL)
    loss.backward()
    expected.backward()
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, ref.grad, **TOL, msg=name)


def test_hf_llama_is_captured_with_export_and_partitioned_at_decoder_layers() -> None:
    reference = MODELS.tiny_llama(2)
    model = copy.deepcopy(reference)
    captured = capture_graph(model, tracer_cls="hf", input_names=["input_ids", "labels"])
    assert captured.route == "export"
    # The decoder layers (the model's _no_split_modules class) stay module calls, called with
    # the arguments the model passed them; nothing of theirs is left inlined.
    assert captured.module_calls == ["model.layers.0", "model.layers.1"]
    nodes = list(captured.graph_module.graph.nodes)
    calls = [n for n in nodes if n.op == "call_module" and n.target.startswith("model.layers")]
    assert [n.target for n in calls] == captured.module_calls
    assert calls[0].kwargs["use_cache"] is False
    assert len(calls[0].kwargs["position_embeddings"]) == 2  # the rotary (cos, sin)
    assert not any(
        path.startswith("model.layers.")
        for n in nodes
        for path, _ in n.meta.get("nn_module_stack", {}).values()
        if n not in calls
    )
    plan = partition_graph(captured, model, ["model.layers.0"], num_stages=2)
    assert "model.layers.0.mlp.up_proj.weight" in plan.stage_parameters[0]
    assert "model.layers.1.mlp.up_proj.weight" in plan.stage_parameters[1]
    assert "model.embed_tokens.weight" in plan.stage_parameters[0]
    # Masks and rotary tables come from the inputs alone: recomputed, not sent.
    assert len(plan.crossing[0]) == 1
    ids = torch.randint(0, 64, (3, 5))  # batch and sequence differ from the capture's
    flat = _chain(plan, model, {"input_ids": ids, "labels": ids, "use_cache": False})
    loss = torch.utils._pytree.tree_unflatten(list(flat), captured.output_spec).loss
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(loss, expected, **TOL)


def test_auto_partition_balances_compute_not_parameters_or_layers() -> None:
    # Tied 2048 x 32 embedding: the lookup on stage 0 multiplies nothing, the tied head on the
    # last stage multiplies all 65.5k weights per token, more than the four 12.6k-weight
    # blocks together. Compute balance cuts after h.3 (50.4k | 65.5k); balancing parameter
    # count would cut after h.0 (the embedding counted on stage 0), layer count after h.1.
    model = TinyGPT(vocab=2048, layers=4, tie_embeddings=True)
    captured = capture_graph(model, leaf_module_cls=(Block,))
    costs = dict(
        zip((n.target for n in captured.graph_module.graph.nodes), node_costs(captured, model))
    )
    block = sum(p.numel() for p in model.h[0].parameters())
    assert (costs["wte"], costs["wpe"], costs["h.0"], costs["lm_head"]) == (0, 0, block, 2048 * 32)
    layers = [f"h.{i}" for i in range(4)]
    assert auto_pipeline_cuts(captured, model, layers, 2) == ["h.3"]
    assert auto_pipeline_cuts(captured, model, layers, 4) == ["h.1", "h.2", "h.3"]
    # A small head (vocab 64): the blocks dominate and the split is the even one.
    assert auto_pipeline_cuts(captured, TinyGPT(layers=4), layers, 2) == ["h.1"]
    with pytest.raises(ValueError, match=r"at least 5 transformer layers.*for 6 stages"):
        auto_pipeline_cuts(captured, model, layers, 6)


def test_bad_cuts_fail_with_the_offending_names() -> None:
    model = TinyGPT(layers=4)
    captured = capture_graph(model, leaf_module_cls=(Block,))
    with pytest.raises(ValueError, match=r"pipeline cut 'h.9' names no module executed"):
        partition_graph(captured, model, ["h.9"], 2)
    with pytest.raises(ValueError, match=r"has 1 names \['h.1'\], but 3 stages need 2 cuts"):
        partition_graph(captured, model, ["h.1"], 3)
    with pytest.raises(ValueError, match=r"\['h.2', 'h.0'\] are not in execution order"):
        partition_graph(captured, model, ["h.2", "h.0"], 3)


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace through this
            return self.linear(x)
        return x


def flip_if_negative(x: torch.Tensor) -> torch.Tensor:
    return x if x.sum() > 0 else -x


class _Net(nn.Module):
    def __init__(self, use_function: bool) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.gate = _Gate()
        self.use_function = use_function

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        x = self.first(x) * scale
        return flip_if_negative(x) if self.use_function else self.gate(x)


def test_trace_errors_name_the_module_and_the_fix() -> None:
    with pytest.raises(PipelineTraceError) as info:
        capture_graph(_Net(use_function=False))
    message = str(info.value)
    assert "module 'gate' (_Gate)" in message
    assert "leaf_module_cls=[_Gate]" in message
    assert "if x.sum() > 0" in message
    captured = capture_graph(_Net(use_function=False), leaf_module_cls=(_Gate,))
    assert "gate" in [n.target for n in captured.graph_module.graph.nodes]
    with pytest.raises(PipelineTraceError, match="autowrap_functions"):
        capture_graph(_Net(use_function=True))
    wrapped = capture_graph(_Net(use_function=True), autowrap_functions=(flip_if_negative,))
    assert flip_if_negative in [n.target for n in wrapped.graph_module.graph.nodes]


def test_input_names_select_the_traced_inputs() -> None:
    captured = capture_graph(_Net(use_function=False), input_names=["x"], leaf_module_cls=(_Gate,))
    assert captured.input_names == ["x"]  # scale fixed to its default
    with pytest.raises(ValueError, match=r"input_names \['y'\] are not parameters of _Net"):
        capture_graph(_Net(use_function=False), input_names=["y"])
    with pytest.raises(ValueError, match=r"tracer_cls must be 'torch', 'hf', None"):
        capture_graph(_Net(use_function=False), tracer_cls="jit")


def test_leaf_classes_may_be_given_by_name(caplog: pytest.LogCaptureFixture) -> None:
    # NxD's form: leaf_module_cls=[LlamaRMSNorm.__name__]
    captured = capture_graph(_Net(use_function=False), leaf_module_cls=["_Gate"])
    assert "gate" in captured.module_calls
    with caplog.at_level("WARNING"):
        capture_graph(_Net(use_function=False), leaf_module_cls=["_Gate", "NoSuchNorm"])
    assert "'NoSuchNorm'; it is ignored" in caplog.text  # NxD ignores it too
    with pytest.raises(TypeError, match=r"classes or class names, got 3"):
        capture_graph(_Net(use_function=False), leaf_module_cls=[3])
    assert layer_class(TinyGPT(), "Block", None) is Block
    with pytest.raises(ValueError, match=r"'Blok' must name exactly one module class.*'Block'"):
        layer_class(TinyGPT(), "Blok", None)


def test_hf_leaf_classes_by_name_keep_the_final_norm_as_a_call() -> None:
    reference = MODELS.tiny_llama(2)
    model = copy.deepcopy(reference)
    captured = capture_graph(
        model,
        tracer_cls="hf",
        input_names=["input_ids", "labels"],
        leaf_module_cls=["LlamaDecoderLayer", "LlamaRMSNorm"],
    )
    # The norms inside the layers run within the layer calls; the final one is its own call.
    assert captured.module_calls == ["model.layers.0", "model.layers.1", "model.norm"]
    plan = partition_graph(captured, model, [], num_stages=1)
    ids = torch.randint(0, 64, (2, 6))
    flat = _chain(plan, model, {"input_ids": ids, "labels": ids, "use_cache": False})
    loss = torch.utils._pytree.tree_unflatten(list(flat), captured.output_spec).loss
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(loss, expected, **TOL)
    loss.backward()
    expected.backward()
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, ref.grad, **TOL, msg=name)


class _Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _Layer(nn.Module):
    def __init__(self, boxed: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.boxed = boxed

    def forward(self, x: torch.Tensor) -> Any:
        y = torch.tanh(self.linear(x))
        return _Box(y) if self.boxed else y


class _ExportNet(nn.Module):
    """forward(input_ids, labels, use_cache) as the export route calls it."""

    def __init__(self, boxed: bool = False, twice: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layer = _Layer(boxed)
        self.head = nn.Linear(8, 16)
        self.boxed, self.twice = boxed, twice

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, use_cache: bool = False):
        h = self.embed(input_ids)
        for _ in range(2 if self.twice else 1):
            h = self.layer(h).value if self.boxed else self.layer(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    ("boxed", "twice", "warning"),
    [
        (True, False, "exporting with every module inlined"),  # output not a pytree
        (False, True, "module layer is called more than once; it stays inlined"),
    ],
)
def test_modules_that_cannot_be_kept_as_calls_stay_inlined(
    boxed: bool, twice: bool, warning: str, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    reference = _ExportNet(boxed, twice)
    model = copy.deepcopy(reference)
    with caplog.at_level("WARNING"):
        captured = capture_graph(model, tracer_cls="hf", leaf_module_cls=[_Layer])
    assert warning in caplog.text
    assert captured.module_calls == []
    plan = partition_graph(captured, model, [], num_stages=1)
    ids = torch.randint(0, 16, (2, 5))
    (loss,) = _chain(plan, model, {"input_ids": ids, "labels": ids, "use_cache": False})
    expected = reference(ids, ids)
    torch.testing.assert_close(loss, expected, **TOL)
    loss.backward()
    expected.backward()
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, ref.grad, **TOL, msg=name)


class _ScaledLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A tensor made during forward on a parameter's device: torch.export lifts it as a
        # constant of the graph, which has no value when the parameters are on meta.
        return self.linear(x) * torch.tensor(0.5, device=self.linear.weight.device)


class _ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.first, self.second = _ScaledLayer(), _ScaledLayer()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(self.embed(input_ids))).sum()


def test_a_constant_made_on_meta_is_named_at_the_build() -> None:
    with torch.device("meta"):
        model = _ScaledNet()
    captured = capture_graph(model, tracer_cls="hf", input_names=["input_ids"])
    assert captured.route == "export"
    plan = partition_graph(captured, model, ["first"], num_stages=2)
    with pytest.raises(PipelineTraceError, match=r"stage 0 needs .*lifted_tensor.* meta device"):
        build_stage_module(plan, model, 0, torch.device("cpu"))
    torch.manual_seed(0)
    real = _ScaledNet()  # the same model with real parameters: the constant has its value
    reference = copy.deepcopy(real)
    captured = capture_graph(real, tracer_cls="hf", input_names=["input_ids"])
    plan = partition_graph(captured, real, ["first"], num_stages=2)
    ids = torch.randint(0, 8, (2, 3))
    (out,) = _chain(plan, real, {"input_ids": ids})  # the export route's outputs: a tuple
    torch.testing.assert_close(out, reference(ids), rtol=0, atol=0)  # same ops, same order


class _KwargsLoss(nn.Module):
    """Takes ``shift_labels`` through ``**kwargs``, as transformers' causal LMs do, and
    flattens it against the inputs: torch.export guards ``B x S`` of both to be equal."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        scores = self.embed(input_ids).sum(-1).reshape(-1)
        return (scores * kwargs["shift_labels"].reshape(-1).float()).sum()


def test_guards_on_keyword_only_inputs_run() -> None:
    """torch 2.15 writes a guard on an input taken through ``**kwargs`` as
    ``L['kwargs']['shift_labels']``, which the exported module's guard function cannot resolve
    (``NameError: name 'L' is not defined`` on every call): the capture rewrites the path."""
    model = _KwargsLoss()
    captured = capture_graph(model, tracer_cls="hf", input_names=["input_ids", "shift_labels"])
    ids = torch.randint(0, 8, (3, 5))  # batch and sequence differ from the capture's
    labels = torch.randint(0, 8, (3, 5))
    got = captured.graph_module(input_ids=ids, shift_labels=labels, **captured.fixed_inputs)
    torch.testing.assert_close(got, model(ids, shift_labels=labels), rtol=0, atol=0)
