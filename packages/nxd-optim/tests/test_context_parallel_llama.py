"""Context-parallel parity: a tiny Llama-style model (nxd's TP layers, GQA attention, rotary by
global position, SwiGLU) trained one step at CP 2 and 4, TP2 x CP2 and CP2 x DP2 with ZeRO-1,
with ring and all-to-all attention, against the same model in one process.

Every rank also runs the one-process reference (the whole batch and sequence, plain torch
modules) and compares: its logits' rows, the loss averaged over DP x CP, and every parameter's
update under SGD(lr=1) through :class:`NxDOptimizer`, which is minus the gradient averaged over
DP x CP: the gradient of the whole batch's mean loss, if the groups are right.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_layers.context_parallel import (
    context_parallel_attention,
    context_parallel_indices,
    split_for_context_parallel,
)
from nxd_optim import NxDOptimizer, OptimizerConfig
from nxd_state.testing import run_distributed

VOCAB, HIDDEN, HEADS, KV_HEADS, HD, FFN = 64, 32, 8, 4, 4, 48
BATCH, SEQ = 2, 16  # SEQ divisible by 2 x CP for CP up to 4 (zigzag)
# fp32: the model chains projections, rotary, softmax (merged blockwise across ranks), MLP and a
# cross-entropy whose sums are split differently over ranks; rounding differences compound to
# a few 1e-7 relative on O(1) values. 1e-5 is ~100x that margin and ~1e5x below any real error
# of a wrong split, mask or reduction group (which changes values at O(1e-2) or more).
TOL = {"rtol": 1e-5, "atol": 1e-5}


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (B, nh, T, hd) at the given global positions (B, T)."""
    hd = x.shape[-1]
    freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angle = positions.float()[:, None, :, None] * freq  # (B, 1, T, hd/2)
    cos, sin = angle.cos().repeat(1, 1, 1, 2), angle.sin().repeat(1, 1, 1, 2)
    half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
    return x * cos + half * sin


class Model(nn.Module):
    """Embedding -> pre-norm GQA attention -> pre-norm SwiGLU -> RMSNorm -> LM head. With
    ``parallel`` the linears and embedding are nxd's TP layers and attention is
    context-parallel; otherwise plain torch and SDPA (the one-process reference)."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel
        if parallel:
            col = lambda i, o: ColumnParallelLinear(i, o, bias=False, gather_output=False)  # noqa: E731
            row = lambda i, o: RowParallelLinear(i, o, bias=False, input_is_parallel=True)  # noqa: E731
            self.embed = ParallelEmbedding(VOCAB, HIDDEN)
            self.head = ColumnParallelLinear(HIDDEN, VOCAB, bias=False, gather_output=True)
        else:
            col = row = lambda i, o: nn.Linear(i, o, bias=False)
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.attn_norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.q, self.k, self.v = (
            col(HIDDEN, HEADS * HD),
            col(HIDDEN, KV_HEADS * HD),
            col(HIDDEN, KV_HEADS * HD),
        )
        self.o = row(HEADS * HD, HIDDEN)
        self.mlp_norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.gate, self.up, self.down = col(HIDDEN, FFN), col(HIDDEN, FFN), row(FFN, HIDDEN)
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, algorithm: str) -> torch.Tensor:
        h = self.embed(ids)
        x = self.attn_norm(h)
        b, t = ids.shape
        q, k, v = (proj(x).view(b, t, -1, HD).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = rope(q, positions), rope(k, positions)
        if self.parallel:
            a = context_parallel_attention(q, k, v, algorithm=algorithm)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, t, -1))
        x = self.mlp_norm(h)
        h = h + self.down(F.silu(self.gate(x)) * self.up(x))
        return self.head(self.norm(h))


ROW_PARALLEL = {"o.weight", "down.weight"}  # split along the input dimension


def shard(name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's TP slice of a reference tensor (norms are replicated)."""
    tp, rank = (
        nxd_state.get_tensor_model_parallel_size(),
        nxd_state.get_tensor_model_parallel_rank(),
    )
    if "norm" in name:
        return full
    return full.chunk(tp, dim=1 if name in ROW_PARALLEL else 0)[rank]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)  # already next-token targets
    return ids, labels


def check(bad: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Record a mismatch (the caller asserts on the list, with every failure named)."""
    try:
        torch.testing.assert_close(got, want, **TOL)
    except AssertionError as error:
        bad.append(f"{what}: {error}")


def train_step(tp: int, cp: int, zero1: bool) -> dict[str, list[str]]:
    """One SGD step per algorithm at (tp, cp, dp = world / (tp cp)); the checks that failed."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    state = nxd_state.get_parallel_state()
    assert state.context_parallel_size == cp
    ids, labels = data()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    torch.manual_seed(1234)
    ref = Model(parallel=False)
    ref_logits = ref(ids, positions, "none")
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    dp, dp_rank = state.data_parallel_size, state.data_parallel_rank
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)  # this DP rank's samples
    group = state.context_parallel_group
    local_ids, local_labels, local_pos = (
        split_for_context_parallel(t[rows], group) for t in (ids, labels, positions)
    )
    cols = context_parallel_indices(SEQ, cp, state.context_parallel_rank)
    failures: dict[str, list[str]] = {}
    for algorithm in ("ring", "all_to_all"):
        bad = failures.setdefault(algorithm, [])
        model = Model(parallel=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, dict(ref.named_parameters())[name]))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = NxDOptimizer(
            model.parameters(),
            torch.optim.SGD,
            config=OptimizerConfig(zero_one_enabled=zero1, grad_clipping=False),
            lr=1.0,
        )
        logits = model(local_ids, local_pos, algorithm)
        loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten())
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=state.data_context_parallel_group)
        mean_loss /= state.data_context_parallel_size

        check(bad, "logits", logits.detach(), ref_logits.detach()[rows][:, cols])
        check(bad, "loss", mean_loss, ref_loss.detach())
        for name, param in model.named_parameters():
            check(bad, f"grad {name}", before[name] - param.detach(), shard(name, ref_grads[name]))
    return failures


@pytest.mark.parametrize(
    ("world", "tp", "cp", "zero1"),
    [(2, 1, 2, False), (4, 1, 4, False), (4, 2, 2, False), (4, 1, 2, True)],
    ids=["cp2", "cp4", "tp2xcp2", "cp2xdp2-zero1"],
)
def test_context_parallel_llama_matches_one_process(
    world: int, tp: int, cp: int, zero1: bool
) -> None:
    for rank, failures in enumerate(run_distributed(train_step, world, tp, cp, zero1)):
        for algorithm, bad in failures.items():
            assert not bad, f"rank {rank} {algorithm}:\n" + "\n".join(bad)
