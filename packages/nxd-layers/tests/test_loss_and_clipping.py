"""parallel_cross_entropy vs F.cross_entropy and clip_grad_norm vs torch's clip_grad_norm_.

Cross entropy: the parallel loss is computed from per-shard max / sum-exp / target logit,
reduced over ranks, where torch uses one log-softmax over the vocabulary: the same math in a
different summation order, so fp32 with torch's defaults (rtol=1.3e-6, atol=1e-5). Label
smoothing eps is NxD's (Megatron's): eps / (V - 1) on every wrong class, i.e. with
s = eps V / (V - 1) the loss (1 - s) nll - s mean_c log p_c, which is term for term
``F.cross_entropy``'s formula with ``label_smoothing=s``: (1 - s) nll + s (-mean_c log p_c). So
the reference is ``F.cross_entropy(label_smoothing=eps V / (V - 1))``, and where s > 1 (which
torch refuses) that formula written out.

Log-probabilities (``from_parallel_logits_to_logprobs``): the same per-shard reductions vs
``log_softmax(...).gather`` on the whole vocabulary, fp32 with torch's defaults.

Clipping: the norm is a sum of squares regrouped by shard and rank (a few ulps apart), and the
clipped gradients scale by the same factor: rtol=1e-5, atol=1e-6 (tight: the values are
O(0.01-1); any mis-counted shard would change the norm by >= 10%). NxD's arguments are checked
at TP=2 x DP=2 with ZeRO-1-style gradient shards (each DP rank holds half of every gradient):
``zero1_optimizer_groups`` as NxD's replica groups or a ProcessGroup, the world reduction of
``zero1_optimizer=True`` alone, ``force_spmd=False``, ``shared`` parameters, and NxD's default
of reducing over the pipeline group.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_gradients,
    clip_grad_norm,
    copy_tensor_model_parallel_attributes,
    from_parallel_logits_to_logprobs,
    full_tensor,
    get_grad_norm,
    parallel_cross_entropy,
)
from nxd_state import count_collectives
from nxd_state.testing import run_distributed

FP32 = {"rtol": 1.3e-6, "atol": 1e-5}  # see the module docstring
NORM = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring
B, S, V = 2, 8, 32


def _nxd_s(eps: float) -> float:
    """NxD's smoothing coefficient s = eps V / (V - 1) (its code's ``smoothing``)."""
    return eps * V / (V - 1)


def _nxd_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    """NxD's formula written out: (1 - s) nll - s mean_c log p_c (for s > 1 too)."""
    log_p = logits.float().log_softmax(-1)
    nll = -log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (1 - _nxd_s(eps)) * nll - _nxd_s(eps) * log_p.mean(-1)


def _ce_large_smoothing(tp: int, single: dist.ProcessGroup) -> None:
    """eps = 0.99 > (V - 1) / V: s > 1, refused by torch's kernel; the formula, TP and one rank."""
    rank, eps = nxd_state.get_tensor_model_parallel_rank(), 0.99
    logits, labels = torch.randn(B, S, V), torch.randint(0, V, (B, S))
    full = logits.clone().requires_grad_()
    ref = _nxd_smoothed_loss(full, labels, eps)
    ref.sum().backward()
    shard = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    loss = parallel_cross_entropy(shard, labels, eps)
    loss.sum().backward()
    torch.testing.assert_close(loss, ref, **FP32)
    torch.testing.assert_close(shard.grad, full.grad.chunk(tp, dim=-1)[rank], **FP32)
    whole = logits.clone().requires_grad_()
    loss_tp1 = parallel_cross_entropy(whole, labels, eps, tensor_parallel_group=single)
    loss_tp1.sum().backward()
    torch.testing.assert_close(loss_tp1, ref, **FP32)
    torch.testing.assert_close(whole.grad, full.grad, **FP32)


def _ce_case(tp: int, smoothing: float, single: dist.ProcessGroup) -> dict[str, float]:
    rank = nxd_state.get_tensor_model_parallel_rank()
    torch.manual_seed(5)
    logits = torch.randn(B, S, V) * 3
    labels = torch.randint(0, V, (B, S))
    labels[0, :3] = -100  # ignored positions
    labels[1, 0], labels[1, 1] = 0, V - 1  # the first and last shard's edges
    upstream = torch.rand(B, S)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(  # NxD's eps over V - 1 classes = torch's s over V (docstring)
        full.reshape(-1, V), labels.reshape(-1), reduction="none", label_smoothing=_nxd_s(smoothing)
    ).reshape(B, S)
    (ref * upstream).sum().backward()
    shard = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    with count_collectives() as counter:
        loss = parallel_cross_entropy(shard, labels, label_smoothing=smoothing)
    (loss * upstream).sum().backward()
    torch.testing.assert_close(loss, ref, **FP32)
    torch.testing.assert_close(shard.grad, full.grad.chunk(tp, dim=-1)[rank], **FP32)
    assert torch.count_nonzero(shard.grad[0, :3]) == 0  # ignored labels: no gradient
    # Only per-token scalars cross ranks: never the vocabulary.
    traffic = counter.total()
    per_token = B * S * 4
    assert traffic.bytes == (4 if smoothing else 3) * per_token
    assert counter.total(op="all_gather").calls == 0
    mean_ref = F.cross_entropy(
        logits.reshape(-1, V),
        labels.reshape(-1),
        reduction="mean",
        label_smoothing=_nxd_s(smoothing),
    )
    mean = parallel_cross_entropy(shard, labels, smoothing, reduction="mean")
    torch.testing.assert_close(mean, mean_ref, **FP32)
    # A TP group of one rank holds the whole vocabulary (torch's fused kernel is used).
    whole = logits.clone().requires_grad_()
    loss_tp1 = parallel_cross_entropy(whole, labels, smoothing, tensor_parallel_group=single)
    (loss_tp1 * upstream).sum().backward()
    torch.testing.assert_close(loss_tp1, ref, **FP32)
    torch.testing.assert_close(whole.grad, full.grad, **FP32)
    return {"loss": float(ref.sum())}


def _logprobs_case(tp: int) -> None:
    """NxD's shifted log-probabilities: (B, S - 1) values and the logits gradient."""
    rank = nxd_state.get_tensor_model_parallel_rank()
    logits, target = torch.randn(B, S, V) * 3, torch.randint(0, V, (B, S))
    target[0, 1], target[1, 2] = 0, V - 1  # the first and last shard's edges
    full = logits.clone().requires_grad_()
    ref = full.log_softmax(-1)[:, :-1].gather(-1, target[:, 1:].unsqueeze(-1)).squeeze(-1)
    upstream = torch.rand(B, S - 1)
    (ref * upstream).sum().backward()
    shard = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    out = from_parallel_logits_to_logprobs(shard, target, inference=False)
    assert out.shape == (B, S - 1)
    torch.testing.assert_close(out, ref, **FP32)
    (out * upstream).sum().backward()
    torch.testing.assert_close(shard.grad, full.grad.chunk(tp, dim=-1)[rank], **FP32)
    frozen = from_parallel_logits_to_logprobs(shard, target)  # inference=True: no graph
    assert not frozen.requires_grad
    torch.testing.assert_close(frozen, ref, **FP32)


def run_cross_entropy(tp: int) -> list[str]:
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective
    for smoothing in (0.0, 0.1):
        _ce_case(tp, smoothing, singles[dist.get_rank()])
    _ce_large_smoothing(tp, singles[dist.get_rank()])
    _logprobs_case(tp)
    shard = torch.randn(B, S, V // tp)
    bad = []
    for kwargs in (
        {"labels": torch.zeros(B, S + 1, dtype=torch.long)},
        {"labels": torch.zeros(B, S, dtype=torch.long), "label_smoothing": 1.5},
        {"labels": torch.zeros(B, S, dtype=torch.long), "label_smoothing": 1.0},
        {"labels": torch.zeros(B, S)},
    ):
        try:
            parallel_cross_entropy(shard, **kwargs)
            bad.append("no error")
        except ValueError as error:
            bad.append(str(error))
    return bad


# clip_grad_norm ---------------------------------------------------------------------------
H, FF = 8, 16


def _reference_blocks(n_blocks: int) -> list[nn.ModuleList]:
    """Per block: Linear(H, FF), Linear(FF, H), LayerNorm(H), with seeded random gradients."""
    torch.manual_seed(11)
    blocks = []
    for _ in range(n_blocks):
        block = nn.ModuleList([nn.Linear(H, FF), nn.Linear(FF, H), nn.LayerNorm(H)])
        for p in block.parameters():
            p.grad = torch.randn_like(p) * 0.3
        blocks.append(block)
    return blocks


def _parallel_block(ref: nn.ModuleList) -> nn.ModuleList:
    tp, rank = (
        nxd_state.get_tensor_model_parallel_size(),
        nxd_state.get_tensor_model_parallel_rank(),
    )
    col, row = ColumnParallelLinear(H, FF, gather_output=False), RowParallelLinear(FF, H)
    norm = nn.LayerNorm(H)
    with torch.no_grad():
        col.weight.grad = ref[0].weight.grad.chunk(tp, 0)[rank].clone()
        col.bias.grad = ref[0].bias.grad.chunk(tp, 0)[rank].clone()
        row.weight.grad = ref[1].weight.grad.chunk(tp, 1)[rank].clone()
        row.bias.grad = ref[1].bias.grad.clone()
        for p, p_ref in zip(norm.parameters(), ref[2].parameters()):
            p.grad = p_ref.grad.clone()
    return nn.ModuleList([col, row, norm])


def run_clipping(tp: int, pp: int, nxd_call: bool = False) -> list[str]:
    """Stage s of the pipeline holds block s of the reference; grads are set, not computed.
    ``nxd_call``: no group argument, NxD's call (the state's PP group is reduced over)."""
    nxd_state.destroy_model_parallel()
    state = nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    pp_group = state.pipeline_parallel_group if pp > 1 else None
    for norm_type in (2.0, math.inf, 1.0):
        refs = _reference_blocks(pp)
        stage = _parallel_block(refs[state.pipeline_parallel_rank])
        ref_params = [p for block in refs for p in block.parameters()]
        norm_ref = torch.nn.utils.clip_grad_norm_(ref_params, 0.1, norm_type=norm_type)
        groups = {} if nxd_call else {"pipeline_parallel_group": pp_group}
        norm = clip_grad_norm(stage.parameters(), 0.1, norm_type=norm_type, **groups)
        assert norm_ref > 0.1  # clipping happened
        torch.testing.assert_close(norm, norm_ref, **NORM, msg=f"norm_type={norm_type}")
        ref_block = refs[state.pipeline_parallel_rank]
        for p, p_ref in zip(stage.parameters(), ref_block.parameters()):
            torch.testing.assert_close(full_tensor(p, p.grad), p_ref.grad, **NORM)
    # A single tensor, and a norm that needs no clipping: returned, gradients untouched.
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective
    lone = nn.Parameter(torch.zeros(3))
    lone.grad = torch.tensor([3.0, 4.0, 0.0])
    assert float(clip_grad_norm(lone, 100.0, tensor_parallel_group=singles[dist.get_rank()])) == 5.0
    assert lone.grad.tolist() == [3.0, 4.0, 0.0]
    messages = []
    for kwargs in ({"norm_type": -1}, {"norm_type": "nan"}, {"max_norm": -1.0}):
        try:
            clip_grad_norm(stage.parameters(), **{"max_norm": 1.0, **kwargs})
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def _zero1_shards(block: nn.ModuleList) -> list[torch.Tensor]:
    """This DP rank's half (along dim 0) of every parameter and gradient, tagged like the
    parameter: the pieces a ZeRO-1 optimizer clips."""
    dp, dp_rank = nxd_state.get_data_parallel_size(), nxd_state.get_data_parallel_rank()
    pieces = []
    for p in block.parameters():
        holder = p.detach().chunk(dp)[dp_rank].clone()
        holder.grad = p.grad.chunk(dp)[dp_rank].clone()
        copy_tensor_model_parallel_attributes(holder, p)
        pieces.append(holder)
    return pieces


def run_zero1_arguments() -> list[str]:
    """TP=2 x DP=2: NxD's zero1_optimizer / zero1_optimizer_groups / force_spmd / shared."""
    nxd_state.destroy_model_parallel()
    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    ref = _reference_blocks(1)[0]
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    replica_groups = nxd_state.get_data_parallel_group(as_list=True)
    for kwargs in (
        {"zero1_optimizer": True, "zero1_optimizer_groups": replica_groups},
        {"zero1_optimizer": True, "zero1_optimizer_groups": state.data_parallel_group},
        {"zero1_optimizer": True},  # the whole world
        {"zero1_optimizer": True, "zero1_optimizer_groups": replica_groups, "force_spmd": False},
    ):
        pieces = _zero1_shards(_parallel_block(ref))
        torch.testing.assert_close(get_grad_norm(pieces, 2, **kwargs), norm_ref, **NORM)
    # Clipping: every shard scaled by the factor torch applies to the whole model.
    pieces = _zero1_shards(_parallel_block(ref))
    twin = nn.Parameter(pieces[0].detach().clone())  # a tied copy, counted elsewhere
    twin.grad, twin.shared = torch.full_like(pieces[0].grad, 100.0), True
    norm = clip_grad_norm([*pieces, twin], 0.1, 2, True, replica_groups)
    torch.testing.assert_close(norm, norm_ref, **NORM)  # the shared copy was left out
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    expected = _zero1_shards(_parallel_block(ref))
    for piece, want in zip(pieces, expected):
        torch.testing.assert_close(piece.grad, want.grad, **NORM)
    # NxD's allreduce_sequence_parallel_gradients(optimizer): marked params summed over TP.
    tp_rank = state.tensor_parallel_rank
    marked, plain = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    marked.sequence_parallel_enabled = True
    marked.grad, plain.grad = torch.full((3,), tp_rank + 1.0), torch.full((3,), tp_rank + 1.0)
    allreduce_sequence_parallel_gradients(torch.optim.SGD([marked, plain], lr=0.1))
    assert marked.grad.tolist() == [3.0] * 3  # 1 + 2 over the two TP ranks
    assert plain.grad.tolist() == [tp_rank + 1.0] * 3
    messages = []
    for kwargs in (
        {"zero1_optimizer_groups": replica_groups},
        {"zero1_optimizer": True, "zero1_optimizer_groups": [[0, 3], [1, 2]]},
        {"zero1_optimizer": True, "data_parallel_group": state.data_parallel_group},
        {
            "zero1_optimizer": True,
            "zero1_optimizer_groups": replica_groups,
            "data_parallel_group": state.data_parallel_group,
        },
    ):
        try:
            get_grad_norm(pieces, **kwargs)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def _float64_norm_power(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    """sum_i ||g_i||_p^p in float64 (max |g| for inf): the exact reference."""
    if p == math.inf:
        return max(g.double().abs().max() for g in grads if g.numel())
    return sum(g.double().abs().pow(p).sum() for g in grads)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, 0.5, math.inf])
def test_grad_norm_in_one_process_matches_torch(norm_type: float) -> None:
    """No process group: float32, bfloat16, float64 and empty gradients, K/V replica counts
    (an int, and per-row for a fused QKV) against the float64 formula and torch's
    ``clip_grad_norm_``. Tolerance: float32 accumulation of ~10^4 terms in a different order
    than float64 (relative error ~1e-6): rtol 1e-5; torch's own bf16 norm is computed in
    bf16, so it is compared on float32 copies of the gradients (torch refuses
    empty gradients under the inf norm: they are left out of its list)."""
    torch.manual_seed(3)
    shapes = [(64, 32), (32,), (7, 5, 3), (0, 4), (1,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float32, torch.bfloat16]
    params = []
    for shape, dtype in zip(shapes, dtypes):
        param = nn.Parameter(torch.zeros(shape, dtype=dtype))
        param.grad = torch.randn(shape, dtype=torch.float32).to(dtype)
        params.append(param)
    expected = _float64_norm_power([p.grad for p in params], norm_type)
    got = get_grad_norm(params, norm_type, tensor_parallel_group=None)
    assert got.dtype == torch.float32
    exact = expected if norm_type == math.inf else expected ** (1.0 / norm_type)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=0.0)
    as_float = [nn.Parameter(p.detach().float()) for p in params if p.numel()]
    for copy in as_float:  # torch's inf norm refuses empty tensors: they are left out
        copy.grad = next(p.grad.float() for p in params if p.shape == copy.shape)
    reference = torch.nn.utils.clip_grad_norm_(as_float, 1e9, norm_type=norm_type)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=0.0)
    # K/V replicas: an int count divides a tensor's share, a per-row tensor each row's.
    kv, fused = nn.Parameter(torch.zeros(8, 4)), nn.Parameter(torch.zeros(4, 3))
    kv.grad, fused.grad = torch.randn(8, 4), torch.randn(4, 3)
    kv.tensor_model_parallel = fused.tensor_model_parallel = True
    kv.tensor_parallel_replicas = 2
    fused.tensor_parallel_replicas = torch.tensor([1.0, 1.0, 2.0, 4.0])
    got = get_grad_norm([*params, kv, fused], norm_type, tensor_parallel_group=None)
    if norm_type == math.inf:
        want = max(expected, _float64_norm_power([kv.grad, fused.grad], norm_type))
    else:
        rows = fused.grad.double().abs().pow(norm_type).sum(dim=1)
        counts = torch.tensor([1.0, 1.0, 2.0, 4.0], dtype=torch.float64)
        want = expected + _float64_norm_power([kv.grad], norm_type) / 2 + (rows / counts).sum()
        want = want ** (1.0 / norm_type)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0)
    assert float(get_grad_norm([], norm_type, tensor_parallel_group=None)) == 0.0


def run_all(world: int) -> dict[str, list[str]]:
    """Cross entropy and clipping at TP=world; with 4 ranks also clipping at TP=2 x PP=2 (the
    PP group given, and NxD's call without it) and NxD's ZeRO-1 arguments at TP=2 x DP=2."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {"cross_entropy": run_cross_entropy(world), "clip": run_clipping(world, 1)}
    if world == 4:
        out["clip_pp"] = run_clipping(2, 2)
        out["clip_pp_nxd_call"] = run_clipping(2, 2, nxd_call=True)
        out["zero1"] = run_zero1_arguments()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_cross_entropy_and_clipping_match_torch(world: int) -> None:
    """Loss and logits gradient vs F.cross_entropy (smoothing, ignored labels, mean), no
    vocabulary gathered; norm and clipped gradients vs clip_grad_norm_ (2, inf, 1; TP, TP+PP)."""
    out = run_distributed(run_all, world, world)[0]
    messages = out["cross_entropy"]
    assert (
        "labels shape (2, 9) must equal the logits shape without the vocabulary dim"
        in (messages[0])
    )
    assert "label_smoothing must be in [0, 1) (NxD's range), got 1.5" in messages[1]
    assert "label_smoothing must be in [0, 1) (NxD's range), got 1.0" in messages[2]
    assert "labels must be integer ids" in messages[3]
    if world == 4:
        zero1 = out["zero1"]
        assert "zero1_optimizer_groups was given with zero1_optimizer=False" in zero1[0]
        assert "[[0, 3], [1, 2]] match none of the current parallel state's groups" in zero1[1]
        assert "reduces over the whole world" in zero1[2]
        assert "pass one of them" in zero1[3]
    for key in ("clip", "clip_pp", "clip_pp_nxd_call") if world == 4 else ("clip",):
        messages = out[key]
        assert "norm_type must be a positive number or inf, got -1" in messages[0]
        assert "norm_type must be a positive number or inf, got 'nan'" in messages[1]
        assert "max_norm must be a non-negative number, got -1.0" in messages[2]
