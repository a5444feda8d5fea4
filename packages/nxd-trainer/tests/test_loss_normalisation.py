"""Loss normalisation with ignored labels (``-100``) spread unevenly over micro-batches, DP
ranks and CP ranks, through the trainer API on a tiny Hugging Face Llama (2 ranks each).

The global batch is 4 rows, one row per micro-batch; row ``i`` has ``COUNTED[i]`` counted
targets, all at the end of the sequence (so at CP2 all-to-all every counted token of a short
row is on the second rank). Two conventions, each compared with one process on every rank
(the reported loss, and every parameter's update under SGD(lr=1), i.e. minus the gradient):

- ``"tokens"``: the token mean of the whole global batch, ``L = Σ ℓ / N`` over all ``N``
  counted targets. Each micro-batch passes ``num_items_in_batch = N / DP`` (the optimizer
  averages over DP x CP; CP divides it by its own degree) and the micro-batch losses are
  summed (no ``scale_gradients``), as transformers' Trainer does. A micro-batch with no
  counted target contributes 0.
- ``"means"`` (NxD's convention): each micro-batch's loss is its own token mean, the step the
  mean of those over micro-batches (``scale_gradients(1/k)``) and DP ranks. A micro-batch with
  no counted target has mean 0 where nxd computes the loss (TP > 1, CP > 1).

fp32; the sums are re-associated (per row, per rank), so round-off only: rtol/atol 1e-5. A
wrong convention moves the loss by O(1e-1) (3 vs 15 counted tokens).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
SEQ = 16
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _data(counted: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and labels: row ``i`` with ``counted[i]`` counted next-token targets, the last ones."""
    ids = torch.randint(0, H.VOCAB, (len(counted), SEQ), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    for row, n in enumerate(counted):
        labels[row, : SEQ - n] = -100
    return ids, labels


def _model() -> torch.nn.Module:
    model = H.model("llama")
    model.config.use_cache = False
    return model


def _reference(
    convention: str, counted: tuple[int, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process: the token mean of the whole batch, or the mean over rows of each row's
    token mean (an empty row's mean 0)."""
    model = _model()
    ids, labels = _data(counted)
    if convention == "tokens":
        loss = model(input_ids=ids, labels=labels).loss
    else:
        rows = [
            model(input_ids=ids[i : i + 1], labels=labels[i : i + 1]).loss
            for i, n in enumerate(counted)
            if n  # an empty row's mean counts as 0 (transformers' own would be 0/0)
        ]
        loss = sum(rows) / len(counted)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def step(convention: str, counted: tuple[int, ...], extra: dict[str, Any]) -> list[str]:
    import nxd_state
    import nxd_trainer as nxd

    zero1 = extra.pop("zero1", False)
    cfg = nxd.neuronx_distributed_config(
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": False}, **extra
    )
    model = nxd.initialize_parallel_model(cfg, _model)
    optimizer = nxd.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=1.0)
    state = nxd_state.get_parallel_state()
    dp, dp_rank = state.data_parallel_size, state.data_parallel_rank
    ref_loss, ref_grads = _reference(convention, counted)
    ids, labels = _data(counted)
    per = len(counted) // dp
    total = sum(counted)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = torch.zeros(())
    for row in range(dp_rank * per, (dp_rank + 1) * per):
        kwargs: dict[str, Any] = {"input_ids": ids[row : row + 1], "labels": labels[row : row + 1]}
        if convention == "tokens":
            kwargs["num_items_in_batch"] = torch.tensor(total / dp)
        loss += model.run_train(**kwargs)
    if convention == "means":
        optimizer.scale_gradients(1 / per)
        loss /= per
    optimizer.step()
    dist.all_reduce(loss, group=state.data_context_parallel_group)
    loss /= state.data_context_parallel_size
    checks = [("loss", loss, ref_loss)]
    for name, param in model.named_parameters():
        update = H.full(param, before[name] - param.detach(), name, model.config)
        checks.append((f"grad {name}", update, ref_grads[name]))
    bad = []
    return bad + H.mismatches(checks, **TOL)


UNEVEN = (3, 15, 1, 9)  # 3 + 15 on DP rank 0, 1 + 9 on DP rank 1
EMPTY = (3, 15, 0, 9)  # DP rank 1's first micro-batch has no counted target
CASES = {
    "dp2-tokens": ("tokens", EMPTY, {}),
    "dp2-zero1-tokens": ("tokens", EMPTY, {"zero1": True}),
    "dp2-means": ("means", UNEVEN, {}),
    "dp2-zero1-means": ("means", UNEVEN, {"zero1": True}),
    "tp2-tokens": ("tokens", EMPTY, {"tensor_parallel_size": 2}),
    "tp2-means-empty": ("means", EMPTY, {"tensor_parallel_size": 2}),
    "cp2-ring-tokens": ("tokens", EMPTY, {"context_parallel_size": 2}),
    "cp2-all-to-all-means-empty": (
        "means", EMPTY, {"context_parallel_size": 2, "context_parallel_algorithm": "all_to_all"}
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_ignored_labels_match_one_process(case: str) -> None:
    convention, counted, extra = CASES[case]
    for rank, bad in enumerate(run_distributed(step, 2, convention, counted, dict(extra))):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)


def test_cp_pipeline_loss_of_a_micro_batch_without_counted_targets_is_zero() -> None:
    """CP x PP's last-stage loss (``pipeline_loss``) on a micro-batch whose labels are all
    ignored: 0 with a zero gradient on every CP rank (0/0 = NaN before), one process."""
    from nxd_trainer._context_parallel import pipeline_loss

    logits = torch.randn(1, SEQ // 2, 11, requires_grad=True)
    shifted = torch.full((1, SEQ), -100)
    loss = pipeline_loss(logits, shifted, 11, shift_labels=shifted[:, : SEQ // 2])
    loss.backward()
    assert loss.item() == 0.0
    assert logits.grad is not None
    assert not logits.grad.any()


# PP2: the pipeline averages its micro-batches' losses (NxD's convention) ----------------------
def pp_step() -> list[str]:
    """PP2 (2 ranks), 2 micro-batches of one row (3 and 15 counted targets): the loss and every
    gradient are the mean of the two rows' token means. ``num_items_in_batch`` is refused with
    the reason (the pipeline divides each micro-batch's loss by ``num_microbatches``: a count
    of the whole batch would be off by that factor)."""
    import nxd_state
    import nxd_trainer as nxd

    counted = UNEVEN[:2]
    ids, labels = _data(counted)
    bad = []
    cfg = nxd.neuronx_distributed_config(
        pipeline_parallel_size=2,
        pipeline_config={
            "num_microbatches": 2,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["model.layers.0"],
        },
        optimizer_config={"zero_one_enabled": False, "grad_clipping": False},
    )
    model = nxd.initialize_parallel_model(cfg, _model)
    try:
        model.run_train(input_ids=ids, labels=labels, num_items_in_batch=sum(counted))
        bad.append("num_items_in_batch at PP2: no error")
    except ValueError as error:
        if "num_items_in_batch with pipeline parallelism" not in str(error):
            bad.append(f"num_items_in_batch at PP2: {error}")
    optimizer = nxd.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model.run_train(input_ids=ids, labels=labels)
    optimizer.step()
    ref_loss, ref_grads = _reference("means", counted)
    checks = []
    if nxd_state.get_parallel_state().pipeline_parallel_rank == 1:
        checks.append(("loss", loss, ref_loss))
    for name, param in model.named_parameters():
        checks.append((f"grad {name}", before[name] - param.detach(), ref_grads[name]))
    return bad + H.mismatches(checks, **TOL)


def test_pp2_averages_micro_batch_token_means_and_refuses_num_items() -> None:
    if not H.pipeline_capture_works():
        pytest.skip(f"transformers below {H.PIPELINE_FIRST_GOOD_TRANSFORMERS}: no PP capture")
    for rank, bad in enumerate(run_distributed(pp_step, 2)):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
