"""NxD's manual partition mode: a list of layers pipelined equals the same layers run in order in
one process (loss and every gradient), and ``output_loss_value_spec=True`` (a bare loss output).

The reference runs ``out = f_L(... f_1([x]))`` and ``loss_fn(out[0], y)`` on the whole batch,
which is what NxD's manual mode computes per microbatch. Tolerance, as in test_parity.py: fp32,
and the pipeline averages per-microbatch mean losses and sums per-microbatch gradients, a
different summation order than one full-batch backward, so results differ by round-off only:
rtol 1e-5, atol 1e-6 (gradients here are O(1e-3..1); a wrong one is off by far more).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import nxd_state
from nxd_pipeline import NxDPPModel, PipelineStageModule, mark_weight_sharing, recv_from, send
from nxd_pipeline.testing import Block, TinyGPT
from nxd_state.testing import load_sibling, run_distributed, run_named_checks

MODELS = load_sibling(__file__, "_models")

TOL = {"rtol": 1e-5, "atol": 1e-6}
HIDDEN = 8
CE = nn.CrossEntropyLoss()


class ListLinear(nn.Linear):
    """NxD's test layer: takes ``x`` or ``[x, ...]``, returns ``[tanh(x A^T + b)]``."""

    def forward(self, x: Any) -> list[torch.Tensor]:  # type: ignore[override]
        if isinstance(x, (list, tuple)):
            x = x[0]
        return [torch.tanh(super().forward(x))]


class ToTensor(nn.Linear):
    """``[x] -> x A^T + b`` (a bare tensor crosses the next cut)."""

    def forward(self, x: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x[0])


class ToTuple(nn.Linear):
    """``x -> (x A^T, 2x, 1[x > 0])``: a tuple, one member without gradient."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return super().forward(x), 2 * x, (x > 0).to(x.dtype)


class FromTuple(nn.Linear):
    """``(a, b, mask) -> [(a A^T) * mask + b]``."""

    def forward(self, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:  # type: ignore[override]
        assert type(x) is tuple, f"FromTuple got a {type(x).__name__}"
        a, b, mask = x
        return [super().forward(a) * mask + b]


class FromList(ListLinear):
    """A :class:`ListLinear` that insists on a list (the container its producer returned)."""

    def forward(self, x: Any) -> list[torch.Tensor]:  # type: ignore[override]
        assert type(x) is list, f"FromList got a {type(x).__name__}"
        return super().forward(x)


class MeanSquare(nn.Module):
    """``[x] -> mean(x^2)``: a last layer that returns the loss itself."""

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return x[0].pow(2).mean()


def _toy(n: int, tie: bool = False) -> list[nn.Module]:
    layers: list[nn.Module] = [ListLinear(HIDDEN, HIDDEN, bias=not tie) for _ in range(n)]
    if tie:  # NxD's weight-sharing test: first and last layer share one weight
        layers[0].weight = layers[-1].weight
        mark_weight_sharing([(layers[0], "weight"), (layers[-1], "weight")], "first_last")
    return layers


def _sequential_loss(
    layers: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor | None, loss_fn: Any
) -> torch.Tensor:
    out: Any = [x]
    for layer in layers:
        out = layer(out)
    if loss_fn is None:
        return out
    return loss_fn(out if isinstance(out, torch.Tensor) else out[0], y)


def _compare(
    reference: Sequence[nn.Module],
    model: NxDPPModel,
    ref_loss: torch.Tensor,
    loss: torch.Tensor,
    label: str,
) -> int:
    """Loss and every local gradient equal the reference's; returns how many were compared."""
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=f"{label}: loss")
    expected = dict(nn.ModuleList(reference).named_parameters(remove_duplicate=False))
    count = 0
    for name, param in model.local_named_parameters():
        assert param.grad is not None, f"{label}: {name} got no gradient"
        torch.testing.assert_close(param.grad, expected[name].grad, **TOL, msg=f"{label}: {name}")
        count += 1
    assert count > 0, f"{label}: this rank compared no gradient"
    return count


def _case(
    layers: list[nn.Module],
    label: str,
    *,
    batch: int = 8,
    microbatches: int = 2,
    loss_fn: Any = CE,
    dp_rows: bool = False,
    **kwargs: Any,
) -> int:
    """Train one step pipelined and in one process; compare. ``dp_rows``: each DP rank gets
    its half of the batch (gradients then averaged over DP equal the full batch's)."""
    reference = copy.deepcopy(layers)
    x = torch.rand(batch, HIDDEN)
    y = torch.randint(0, HIDDEN, (batch,))
    ref_loss = _sequential_loss(reference, x, y, loss_fn)
    ref_loss.backward()
    if dp_rows:
        state = nxd_state.get_parallel_state()
        x = x.chunk(state.data_parallel_size)[state.data_parallel_rank]
        y = y.chunk(state.data_parallel_size)[state.data_parallel_rank]
    model = NxDPPModel(
        layers,
        num_microbatches=microbatches,
        manual_pp_partition=True,
        manual_pp_loss_fn=loss_fn,
        broadcast_and_average_loss=True,
        **kwargs,
    )
    loss = model.run_train(inputs=x, labels=y if loss_fn is not None else None)
    return _compare(reference, model, ref_loss, loss, label)


def _stages_by_position(stages: list[int]) -> Callable[[Sequence[nn.Module], int], dict]:
    def partition(layers: Sequence[nn.Module], num_stages: int) -> dict[nn.Module, int]:
        assert num_stages == max(stages) + 1
        return dict(zip(layers, stages))

    return partition


def _mixed_containers() -> int:
    # 4 stages (p = 2, v = 2): a tensor, a tuple (one member without gradient) and a list
    # cross the three cuts, and each arrives in its own container (the layers check).
    torch.manual_seed(3)
    layers = [
        ListLinear(HIDDEN, HIDDEN),
        ToTensor(HIDDEN, HIDDEN),
        ToTuple(HIDDEN, HIDDEN),
        FromTuple(HIDDEN, HIDDEN),
        FromList(HIDDEN, HIDDEN),
    ]
    return _case(
        layers,
        "mixed containers, interleaved",
        virtual_pipeline_size=2,
        manual_pp_stage_partition_fn=_stages_by_position([0, 0, 1, 2, 3]),
        microbatches=4,
    )


def _separate_marked_copies() -> int:
    # Marked, not tied: each rank's copy is its own tensor, and rank 1's starts different.
    # NxDPPModel copies the lowest rank's value over and sums the gradients, so the step
    # equals the tied reference's.
    torch.manual_seed(4)
    tied = _toy(4, tie=True)
    layers = copy.deepcopy(tied)
    layers[-1].weight = nn.Parameter(layers[0].weight.detach().clone())
    if nxd_state.get_parallel_state().pipeline_parallel_rank == 1:
        with torch.no_grad():
            layers[-1].weight.mul_(-3.0)  # must be overwritten by rank 0's value
    x = torch.rand(8, HIDDEN)
    y = torch.randint(0, HIDDEN, (8,))
    ref_loss = _sequential_loss(tied, x, y, nn.CrossEntropyLoss())
    ref_loss.backward()
    model = NxDPPModel(
        layers,
        num_microbatches=2,
        manual_pp_partition=True,
        manual_pp_loss_fn=nn.CrossEntropyLoss(),
        broadcast_and_average_loss=True,
    )
    loss = model.run_train(inputs=x, labels=y)
    return _compare(tied, model, ref_loss, loss, "marked separate copies")


def _meta_layers() -> int:
    reference = _toy(4)
    with torch.no_grad():
        for layer in reference:
            MODELS.deterministic_init(layer)
    with torch.device("meta"):
        lazy = _toy(4)
    x = torch.rand(8, HIDDEN)
    y = torch.randint(0, HIDDEN, (8,))
    ref_loss = _sequential_loss(reference, x, y, nn.CrossEntropyLoss())
    ref_loss.backward()
    model = NxDPPModel(
        lazy,
        num_microbatches=2,
        manual_pp_partition=True,
        manual_pp_loss_fn=nn.CrossEntropyLoss(),
        param_init_fn=MODELS.deterministic_init,
        broadcast_and_average_loss=True,
    )
    held = {f"{i}.{n}" for i, layer in enumerate(lazy) for n, p in layer.named_parameters()}
    held = {name for name in held if not nn.ModuleList(lazy).get_parameter(name).is_meta}
    assert held == {name for name, _ in model.local_named_parameters()}, held
    loss = model.run_train(inputs=x, labels=y)
    return _compare(reference, model, ref_loss, loss, "meta layers")


def _eval_and_loss_options() -> int:
    torch.manual_seed(5)
    layers = _toy(4)
    reference = copy.deepcopy(layers)
    x = torch.rand(8, HIDDEN)
    y = torch.randint(0, HIDDEN, (8,))
    model = NxDPPModel(
        layers,
        num_microbatches=4,
        manual_pp_partition=True,
        manual_pp_loss_fn=nn.CrossEntropyLoss(),
        return_mb_loss=True,
    )
    losses = model.run_eval(inputs=[x], labels=[y])  # NxD also takes lists of tensors
    with torch.no_grad():
        expected = [
            _sequential_loss(reference, xs, ys, nn.CrossEntropyLoss())
            for xs, ys in zip(x.chunk(4), y.chunk(4))
        ]
    if nxd_state.get_parallel_state().is_pipeline_last_stage:
        assert len(losses) == 4
        for got, want in zip(losses, expected):
            torch.testing.assert_close(got, want, **TOL)
    else:
        assert losses is None  # only the last stage holds losses without broadcasting
    assert all(p.grad is None for p in model.parameters())  # eval ran no backward
    # return_loss_on_cpu=False keeps the loss where the stages run (here also the CPU).
    mean = NxDPPModel(
        copy.deepcopy(reference),
        num_microbatches=2,
        manual_pp_partition=True,
        manual_pp_loss_fn=nn.CrossEntropyLoss(),
        broadcast_and_average_loss=True,
        return_loss_on_cpu=False,
    ).run_eval(inputs=x, labels=y)
    with torch.no_grad():
        full = _sequential_loss(reference, x, y, nn.CrossEntropyLoss())
    torch.testing.assert_close(mean, full, **TOL)
    return 4


def _bad_inputs() -> int:
    model = NxDPPModel(
        _toy(4), num_microbatches=2, manual_pp_partition=True, manual_pp_loss_fn=nn.MSELoss()
    )
    x = torch.rand(8, HIDDEN)
    checks: list[tuple[Callable[[], Any], str]] = [
        (lambda: model.run_train(input_ids=x, labels=x), r"take inputs=\.\.\. and labels"),
        (lambda: model.run_train(inputs=x[:3], labels=x[:3]), r"shape \(3, 8\).*by "),
        (lambda: model.run_train(inputs=[x, x[:4]], labels=x), "different batch sizes"),
        (lambda: NxDPPModel(_toy(4)), "needs manual_pp_partition=True"),
        (lambda: NxDPPModel(nn.Linear(2, 2), manual_pp_partition=True), "list of layers"),
        (
            lambda: NxDPPModel(_toy(4), manual_pp_partition=True, pipeline_cuts=["1"]),
            "drop pipeline_cuts",
        ),
        (lambda: NxDPPModel(_toy(1), manual_pp_partition=True), "1 layers cannot fill 2"),
        (
            lambda: NxDPPModel(
                _toy(3),
                manual_pp_partition=True,
                manual_pp_stage_partition_fn=_stages_by_position([1, 0, 1]),
            ),
            r"stages \[1, 0, 1\]",
        ),
        (
            lambda: NxDPPModel(_toy(4), manual_pp_partition=True, output_loss_value_spec=False),
            "marks no value True",
        ),
        (
            lambda: NxDPPModel(_toy(4), manual_pp_partition=True, _no_such_option=1),
            r"unexpected keyword arguments \['_no_such_option'\]",
        ),
    ]
    for call, pattern in checks:
        with pytest.raises((ValueError, TypeError), match=pattern):
            call()
    return len(checks)


def two_rank_checks() -> dict[str, int]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    out: dict[str, int] = {}

    def record(name: str, run: Callable[[], int]) -> Callable[[], None]:
        return lambda: out.__setitem__(name, run())

    checks = {
        # NxD's own manual-PP test, with its arguments: 8 layers evenly on 2 stages, cross
        # entropy on the last (its XLA runtime knobs are accepted and do nothing here).
        "nxd toy 1f1b": record(
            "nxd toy 1f1b",
            lambda: _case(
                _toy(8),
                "toy 1f1b",
                manual_pp_stage_partition_fn=None,
                return_loss_on_cpu=True,
                _use_gloo_for_metadata_comm=False,
                _all_reduce_send_recv=False,
            ),
        ),
        "nxd toy zb_h1": record(
            "nxd toy zb_h1", lambda: _case(_toy(8), "toy zb_h1", schedule="zb_h1", microbatches=4)
        ),
        "nxd toy gpipe sync p2p": record(
            "nxd toy gpipe sync p2p",
            lambda: _case(_toy(8), "toy gpipe sync", schedule="gpipe", async_sends=False),
        ),
        "tied first/last": record("tied first/last", lambda: _case(_toy(4, tie=True), "tied")),
        "marked separate copies": record("marked separate copies", _separate_marked_copies),
        "mixed containers": record("mixed containers", _mixed_containers),
        "loss from the last layer, spec=True": record(
            "loss from the last layer, spec=True",
            lambda: _case(
                [*_toy(3), MeanSquare()],
                "spec=True",
                loss_fn=None,
                output_loss_value_spec=True,
            ),
        ),
        "meta layers": record("meta layers", _meta_layers),
        "eval and loss options": record("eval and loss options", _eval_and_loss_options),
        "errors": record("errors", _bad_inputs),
        # Traced mode, output_loss_value_spec=True: TinyGPT's forward returns the loss itself.
        "gpt spec=True": record("gpt spec=True", _gpt_spec_true),
    }
    run_named_checks(checks, context="pp=2")
    nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=1)  # DP = 2
    # p = 1, v = 2: both stages on this rank, the marker-packed list handed over without p2p.
    out["pp1 v2 x dp2"] = _case(
        _toy(4), "pp1 v2 dp2", virtual_pipeline_size=2, batch=16, dp_rows=True
    )
    return out


def _gpt_spec_true() -> int:
    torch.manual_seed(0)
    reference = TinyGPT(layers=4)
    ids = torch.randint(0, 64, (4, 8))
    ref_loss = reference(ids, ids)
    ref_loss.backward()
    model = NxDPPModel(
        copy.deepcopy(reference),
        transformer_layer_cls=Block,
        num_microbatches=2,
        output_loss_value_spec=True,
        pipeline_cuts=["h.1"],
        broadcast_and_average_loss=True,
    )
    loss = model.run_train(input_ids=ids, labels=ids)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    expected = dict(reference.named_parameters())
    count = 0
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, **TOL, msg=name)
        count += 1
    return count


def _neighbour_transfers() -> int:
    """NxD's ``pipeline.comm`` send / recv_from: to the next rank, then back to the previous
    (even ranks send first, odd ranks receive first, so the blocking ring cannot deadlock)."""
    rank = nxd_state.get_parallel_state().pipeline_parallel_rank
    meta = SimpleNamespace(shape=(3,), dtype=torch.float32, requires_grad=True)
    for forward in (True, False):
        mine = torch.full((3,), float(rank if forward else 10 + rank))
        if rank % 2 == 0:
            send(mine, send_next=forward)
            got = recv_from(meta, recv_prev=forward)
        else:
            got = recv_from(meta, recv_prev=forward)
            send(mine, send_next=forward)
        peer = (rank - 1) % 4 if forward else (rank + 1) % 4
        torch.testing.assert_close(got, torch.full((3,), float(peer if forward else 10 + peer)))
        assert got.requires_grad
    return 2


def four_rank_checks() -> dict[str, int]:
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=4)
    out = {
        "pp4 toy 1f1b": _case(_toy(8), "pp4 1f1b", microbatches=4),
        "pp4 tied zb_h1": _case(_toy(8, tie=True), "pp4 tied zb_h1", schedule="zb_h1"),
        "send / recv_from": _neighbour_transfers(),
    }
    nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)  # DP = 2
    out["pp2 x dp2"] = _case(_toy(4), "pp2 dp2", batch=16, dp_rows=True)
    return out


def test_manual_partition_two_ranks_matches_sequential_layers() -> None:
    results = run_distributed(two_rank_checks, 2)
    for rank, result in enumerate(results):
        assert all(n > 0 for n in result.values()), (rank, result)
    # The two ranks together compared all 8 layers' weights and biases once.
    assert results[0]["nxd toy 1f1b"] + results[1]["nxd toy 1f1b"] == 16
    # 4 bias-free layers, the first and last sharing a weight: each rank compared its copy of
    # the shared weight and its other layer's weight.
    assert results[0]["tied first/last"] == results[1]["tied first/last"] == 2


def test_manual_partition_four_ranks_matches_sequential_layers() -> None:
    results = run_distributed(four_rank_checks, 4)
    for rank, result in enumerate(results):
        assert all(n > 0 for n in result.values()), (rank, result)
    assert sum(r["pp4 toy 1f1b"] for r in results) == 16


def test_stage_module_partitions_like_nxd() -> None:
    layers = _toy(8)
    stages = [PipelineStageModule(layers, 3, s) for s in range(3)]
    # NxD's even split: 8 // 3 = 2 layers per stage, the remainder on the last stage.
    assert [s.layer_indices for s in stages] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert [n for n, _ in stages[1].named_parameters()] == [
        "2.weight",
        "2.bias",
        "3.weight",
        "3.bias",
    ]
    x = torch.rand(2, HIDDEN)
    out: Any = [x]
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out[0], _sequential_loss(layers, x, None, None)[0])
