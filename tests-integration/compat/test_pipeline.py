"""NxD-style pipelines (PP=2 x DP=2 on 4 gloo ranks) equal one process.

* Manual partition, the pattern of NxD's manual-pipeline integration test: a list of layers that
  take and return lists, ``NxDPPModel(module=layers, manual_pp_partition=True,
  manual_pp_stage_partition_fn=None, manual_pp_loss_fn=CrossEntropyLoss(), return_loss_on_cpu=True,
  broadcast_and_average_loss=True)`` plus NxD's private runtime knobs, SGD over
  ``local_parameters()``, each DP rank feeding its slice of the batch to
  ``run_train(inputs=..., labels=...)``; with and without a weight shared by the first and last
  layer (``PipelineStageModule.mark_weight_sharing``). Every step's loss and every local
  parameter must follow the single-process run on the whole batch.
* A traced model whose forward returns the bare loss (``output_loss_value_spec=True``), cut by
  ``auto_partition=True``: each local gradient, found by its original name through
  ``local_named_parameters()``, equals the one-process gradient of the loss scaled as NxD's
  runtime scales it (the mean over microbatches, then over DP ranks).

Tolerance: float32 with the same products; microbatch and DP means are sums in another order
and gradients are averaged over DP by an all-reduce: rtol 1e-5 (NxD's own test uses 1e-5 on the
losses), atol 1e-6.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from nxd_state.testing import run_distributed, run_named_checks

PP, DP = 2, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}
HIDDEN, LAYERS, MICROBATCHES, MBS, STEPS = 8, 4, 2, 4, 3


class WrappedLinear(nn.Linear):
    """A layer of NxD's manual-pipeline test model: takes and returns a list."""

    def forward(self, x):  # type: ignore[override]
        if isinstance(x, list | tuple):
            x = x[0]
        return [super().forward(x)]


def _toy_layers(weight_sharing: bool) -> list[WrappedLinear]:
    torch.manual_seed(1234)
    layers = [WrappedLinear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)]
    if weight_sharing:
        layers[0].weight = layers[-1].weight
    return layers


def _dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (
            torch.rand(MBS * DP, HIDDEN, generator=gen),
            torch.randint(0, HIDDEN, (MBS * DP,), generator=gen),
        )
        for _ in range(STEPS)
    ]


def check_manual_pipeline(weight_sharing: bool) -> None:
    from neuronx_distributed.parallel_layers.parallel_state import get_data_parallel_rank
    from neuronx_distributed.pipeline.manual_pipe_stage import PipelineStageModule
    from neuronx_distributed.pipeline.model import NxDPPModel

    reference = nn.Sequential(*_toy_layers(weight_sharing))
    layers = copy.deepcopy(list(reference))  # deepcopy of the list keeps the tie
    if weight_sharing:
        PipelineStageModule.mark_weight_sharing(
            [(layers[0], "weight"), (layers[-1], "weight")], "shared_first_last_layer_weight"
        )
    model = NxDPPModel(
        module=layers,
        num_microbatches=MICROBATCHES,
        manual_pp_partition=True,
        manual_pp_stage_partition_fn=None,
        manual_pp_loss_fn=nn.CrossEntropyLoss(),
        _use_gloo_for_metadata_comm=False,
        _all_reduce_send_recv=False,
        return_loss_on_cpu=True,
        broadcast_and_average_loss=True,
    )
    optimizer = torch.optim.SGD(model.local_parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    dp_rank = get_data_parallel_rank()
    for step, (inputs, labels) in enumerate(_dataset()):
        local = slice(dp_rank * MBS, (dp_rank + 1) * MBS)
        loss = model.run_train(inputs=inputs[local], labels=labels[local])
        ref_loss = nn.functional.cross_entropy(reference(inputs)[0], labels)
        ref_loss.backward()
        assert loss.device.type == "cpu"
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=f"loss of step {step}")
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    local = dict(model.local_named_parameters())
    assert local, "this stage holds no layer"
    for name, param in local.items():  # nn.Sequential names: "<layer index>.weight"
        torch.testing.assert_close(param, ref_params[name], **TOL, msg=name)


class SingleLinearBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x.transpose(0, 1))).transpose(0, 1)


class SingleLayerOutputModule(nn.Module):
    """NxD's bare-loss pipeline test model: the forward returns a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SingleLinearBlock() for _ in range(4)])
        self.output_proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, 1)
        for layer in self.layers:
            x = layer(x)
        return torch.sum(self.output_proj(x.transpose(0, 1)))


def check_bare_loss_auto_partition() -> None:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.pipeline.model import NxDPPModel

    torch.manual_seed(1234)
    model = SingleLayerOutputModule()
    global_batch = 8
    example = torch.randn(global_batch, 4, 4)
    # NxD's runtime: loss / microbatches on each rank, gradients averaged over DP
    (model(example) / (MICROBATCHES * DP)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    per_replica = global_batch // parallel_state.get_data_parallel_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    pp_model = NxDPPModel(
        model,
        transformer_layer_cls=SingleLinearBlock,
        auto_partition=True,
        num_microbatches=MICROBATCHES,
        output_loss_value_spec=True,
        input_names=["x"],
    )
    pp_model.run_train(x=example.narrow(0, dp_rank * per_replica, per_replica).clone())
    local = dict(pp_model.local_named_parameters())
    assert local
    assert set(local) <= set(expected)  # the original names
    for name, param in local.items():
        torch.testing.assert_close(param.grad, expected[name], **TOL, msg=name)


def pipeline_suite() -> list[str]:
    from neuronx_distributed.parallel_layers import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=PP)
    return run_named_checks(
        {
            "manual partition": lambda: check_manual_pipeline(weight_sharing=False),
            "manual partition, shared weight": lambda: check_manual_pipeline(weight_sharing=True),
            "bare loss, auto partition": check_bare_loss_auto_partition,
        }
    )


def test_nxd_style_pipelines_match_one_process() -> None:
    results = run_distributed(pipeline_suite, PP * DP)
    assert all(len(names) == 3 for names in results)
