"""A tiny causal LM built from nxd's TP layers, for the trainer's tests and benchmark.

``TinyLM(vocab, hidden, layers, heads, tensor_parallel, sequence_parallel, dropout)``, batch
first ``(B, T, H)``:

* :class:`Embed`: token embedding (``ParallelEmbedding``, vocabulary-sharded, under TP), then
  dropout; with sequence parallelism the output is this rank's ``T / tp`` positions;
* :class:`Block` (pre-norm): ``x + Dropout(SelfAttention(LN(x)))``, then
  ``x + Dropout(W2 · gelu(W1 · LN(x)))``; :class:`SelfAttention` is ``O · CoreAttention(Q, K,
  V)``, Q/K/V/W1 column-parallel, O/W2 row-parallel;
  :class:`CoreAttention` is ``Dropout(softmax(QK^T / sqrt(d) + causal)) V``, its dropout drawn
  from the TP-distinct RNG stream (``nxd_state.get_rng_tracker().fork()``), as in Megatron;
* :class:`Head`: final norm, vocabulary-parallel LM head and ``parallel_cross_entropy``; the
  loss is the mean next-token cross entropy.

Without ``tensor_parallel`` the same names hold ``nn.Embedding`` / ``nn.Linear`` /
``F.cross_entropy``: the single-process reference. :func:`deterministic_init` fills every
parameter from its module's ``init_key``, its name and its *full* (unsharded) shape, then keeps
this rank's slice, so plain, TP, pipelined and meta-initialised models start equal. For
pipelining, ``Block`` is the transformer layer and ``Embed`` / ``Head`` are leaves.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

import nxd_state

__all__ = [
    "Block",
    "CoreAttention",
    "Embed",
    "Head",
    "SelfAttention",
    "TinyLM",
    "deterministic_init",
]


def _tp_size() -> int:
    return nxd_state.get_tensor_model_parallel_size()


def _dropout(x: torch.Tensor, p: float, training: bool, parallel_region: bool) -> torch.Tensor:
    """Dropout; inside a TP/SP region (activations differ per TP rank) from the TP stream."""
    if p == 0.0 or not training:
        return x
    if parallel_region:
        with nxd_state.get_rng_tracker().fork():
            return F.dropout(x, p, training)
    return F.dropout(x, p, training)


class Embed(nn.Module):
    """h = Dropout(E[ids]); with SP, this rank's slice of the sequence."""

    def __init__(self, vocab: int, hidden: int, tp: bool, sp: bool, dropout: float) -> None:
        super().__init__()
        self.sequence_parallel, self.p = sp, dropout
        if tp:
            from nxd_layers import ParallelEmbedding

            self.wte: nn.Module = ParallelEmbedding(
                vocab, hidden, sequence_parallel_enabled=sp, sequence_dimension=1
            )
        else:
            self.wte = nn.Embedding(vocab, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _dropout(self.wte(input_ids), self.p, self.training, self.sequence_parallel)


class CoreAttention(nn.Module):
    """Dropout(softmax(Q K^T / sqrt(d) + causal mask)) V, per local head."""

    def __init__(self, dropout: float, tp: bool) -> None:
        super().__init__()
        self.p, self.tp = dropout, tp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[-2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, nh, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return _dropout(probs, self.p, self.training, self.tp) @ v


class SelfAttention(nn.Module):
    """O · CoreAttention(Q x, K x, V x): heads split over TP ranks (Q/K/V column-parallel,
    O row-parallel); the number of local heads is read from the shapes, so padded heads work."""

    def __init__(self, hidden: int, heads: int, tp: bool, sp: bool, dropout: float) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.head_dim = hidden // heads
        self.q_proj = _linear(hidden, hidden, tp, sp, "column")
        self.k_proj = _linear(hidden, hidden, tp, sp, "column")
        self.v_proj = _linear(hidden, hidden, tp, sp, "column")
        self.core = CoreAttention(dropout, tp)
        self.o_proj = _linear(hidden, hidden, tp, sp, "row")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(h)
        b, t = q.shape[0], q.shape[1]  # t: the whole sequence (gathered under SP)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh_local, T, hs)
        k = self.k_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, -1)  # (B, T, H_local)
        return self.o_proj(y)


class Block(nn.Module):
    """x + Dropout(Attn(LN(x))), then x + Dropout(MLP(LN(x)))."""

    def __init__(self, hidden: int, heads: int, tp: bool, sp: bool, dropout: float) -> None:
        super().__init__()
        self.p, self.sequence_parallel = dropout, sp
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, tp, sp, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = _linear(hidden, 4 * hidden, tp, sp, "column")
        self.out = _linear(4 * hidden, hidden, tp, sp, "row")
        if sp:
            from nxd_layers import mark_sequence_parallel_parameter

            for param in [*self.ln_1.parameters(), *self.ln_2.parameters()]:
                mark_sequence_parallel_parameter(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _dropout(self.attn(self.ln_1(x)), self.p, self.training, self.sequence_parallel)
        m = self.out(F.gelu(self.fc(self.ln_2(x))))
        return x + _dropout(m, self.p, self.training, self.sequence_parallel)


class Head(nn.Module):
    """Mean over tokens t < T-1 of CE(W LN(h_t), y_{t+1}); W vocabulary-parallel under TP."""

    def __init__(self, vocab: int, hidden: int, tp: bool, sp: bool) -> None:
        super().__init__()
        self.tp = tp
        self.ln_f = nn.LayerNorm(hidden)
        if tp:
            from nxd_layers import ColumnParallelLinear, mark_sequence_parallel_parameter

            self.lm_head: nn.Module = ColumnParallelLinear(
                hidden,
                vocab,
                bias=False,
                gather_output=False,
                sequence_parallel_enabled=sp,
                sequence_dimension=1,
            )
            if sp:
                for param in self.ln_f.parameters():
                    mark_sequence_parallel_parameter(param)
        else:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(h))  # (B, T, V_local), the whole sequence
        logits, targets = logits[:, :-1], labels[:, 1:]
        if self.tp:
            from nxd_layers import parallel_cross_entropy

            return parallel_cross_entropy(logits.contiguous(), targets.contiguous()).mean()
        flat = logits.reshape(-1, logits.shape[-1]).float()  # fp32 loss, as the parallel one
        return F.cross_entropy(flat, targets.reshape(-1))


def _linear(n_in: int, n_out: int, tp: bool, sp: bool, kind: str) -> nn.Module:
    if not tp:
        return nn.Linear(n_in, n_out)
    from nxd_layers import ColumnParallelLinear, RowParallelLinear

    if kind == "column":
        return ColumnParallelLinear(
            n_in, n_out, gather_output=False, sequence_parallel_enabled=sp, sequence_dimension=1
        )
    return RowParallelLinear(
        n_in, n_out, input_is_parallel=True, sequence_parallel_enabled=sp, sequence_dimension=1
    )


class TinyLM(nn.Module):
    """Embed -> Block x layers -> Head; ``forward(input_ids, labels)`` returns the loss."""

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 32,
        layers: int = 4,
        heads: int = 4,
        *,
        tensor_parallel: bool = False,
        sequence_parallel: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        tp, sp = tensor_parallel, sequence_parallel
        self.embed = Embed(vocab, hidden, tp, sp, dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, tp, sp, dropout) for _ in range(layers))
        self.head = Head(vocab, hidden, tp, sp)
        # What NxD's pad_model reads from a Hugging Face-style model.
        self.config = SimpleNamespace(num_attention_heads=heads)
        for key, (_, module) in enumerate(self.named_modules()):
            module.init_key = key  # deterministic_init's seed

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h, labels)


@torch.no_grad()
def deterministic_init(module: nn.Module) -> None:
    """Fill ``module``'s own parameters from (init_key, name, full shape); keep this rank's
    slice of TP-sharded ones. The same values on any device and at any TP degree."""
    key = getattr(module, "init_key", 0)
    for name, param in module.named_parameters(recurse=False):
        shape = list(param.shape)
        sharded = getattr(param, "tensor_model_parallel", False)
        if sharded:
            dim: int = param.partition_dim  # type: ignore[attr-defined]  # nxd_layers' attribute
            shape[dim] *= _tp_size()
        n = math.prod(shape)
        phase = 0.61 * key + 1.3 * len(name)
        values = torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + phase).reshape(shape)
        if isinstance(module, nn.LayerNorm):
            full = 1.0 + 0.1 * values if name == "weight" else 0.02 * values
        elif name == "bias":
            full = 0.02 * values
        else:
            full = values * (0.5 / math.sqrt(shape[-1]))
        if sharded:
            rank = nxd_state.get_tensor_model_parallel_rank()
            full = full.chunk(_tp_size(), dim=dim)[rank]
        param.copy_(full.to(param.dtype))
