"""Cross entropy over vocabulary-sharded logits, never gathering the vocabulary.

loss_t = log sum_c exp(z_tc) - z_t,y_t. Label smoothing eps follows NxD and Megatron: the
mass eps goes to the V - 1 wrong classes (eps / (V - 1) each), which with s = eps V / (V - 1) is
loss_t = (1 - s) * (log Z_t - z_t,y_t) - s * mean_c log p_tc
       = (1 - s) * (log Z_t - z_t,y_t) + s * (log Z_t - mean_c z_tc),
i.e. ``F.cross_entropy(..., label_smoothing=s)`` (which spreads its argument over all V classes).
V and the mean are the whole vocabulary's, on every rank: NxD's and Megatron's code take them
from the local shard when TP > 1 (Megatron-LM issue #737), a rank-dependent loss; here every TP
degree gives NxD's TP=1 value. Each rank holds the columns ``[r V/p, (r+1) V/p)`` of z: the max,
sum of exponentials, target logit and sum of logits are reduced over TP as scalars per token
(3 or 4 all-reduces of ``b·s`` floats).
Backward: dL/dz = softmax(z) - (1 - s) onehot(y) - s / V, local columns only.

:func:`from_parallel_logits_to_logprobs` gives log p(y_{t+1} | z_t) = z_t,y - log Z_t from the
same sharded logits (NxD's, for preference / RL losses), with dL/dz = (onehot(y) - softmax(z))
times the upstream gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup, ReduceOp

from nxd_layers import _ops
from nxd_layers._attributes import resolve_tensor_parallel_group
from nxd_layers._ops import smoothing_coefficient
from nxd_state import collectives

__all__ = ["from_parallel_logits_to_logprobs", "parallel_cross_entropy"]


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        label_smoothing: float,
        ignore_index: int,
        group: ProcessGroup,
    ) -> torch.Tensor:
        loss, softmax, local_labels, outside, ignored = _ops.ce_forward(
            logits, labels, label_smoothing, ignore_index, group
        )
        ctx.save_for_backward(softmax, local_labels, outside, ignored)
        vocab = logits.shape[-1] * collectives.group_size(group)
        ctx.smoothing = smoothing_coefficient(label_smoothing, vocab)
        ctx.vocab, ctx.dtype = vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local_labels, outside, ignored = ctx.saved_tensors
        grad = _ops.ce_backward(
            softmax, local_labels, outside, ignored, grad_loss, ctx.smoothing, ctx.vocab, ctx.dtype
        )
        return grad, None, None, None, None


def parallel_cross_entropy(
    parallel_logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    ignore_index: int = -100,
    reduction: str = "none",
    tensor_parallel_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of vocab-sharded logits (NxD returns ``reduction="none"``).

    ``parallel_logits``: ``(..., V / tp)``, this rank's vocabulary columns;
    ``labels``: ``(...)``, unsharded global ids; ``ignore_index`` positions get loss 0 (and
    are left out of the ``"mean"``, as in ``F.cross_entropy``). ``label_smoothing`` eps in
    ``[0, 1)`` is NxD's (Megatron's): eps / (V - 1) on each wrong class, the loss of
    ``F.cross_entropy(label_smoothing=eps V / (V - 1))`` (see the module docstring). Returns
    float32.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1) (NxD's range), got {label_smoothing}")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if parallel_logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the logits shape without the "
            f"vocabulary dim, {tuple(parallel_logits.shape[:-1])}"
        )
    if labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"labels must be integer ids, got dtype {labels.dtype}")
    group = resolve_tensor_parallel_group(tensor_parallel_group)
    tp = collectives.group_size(group)
    smoothing = smoothing_coefficient(label_smoothing, parallel_logits.shape[-1] * tp)
    if _ops.use_operators():
        # Captured: one operator node with its backward registered, at TP = 1 too (torch's
        # meta kernel for F.cross_entropy(reduction="none") gives the wrong shape under
        # dynamic shapes, which a pipeline's capture of a meta-device model uses).
        key = _ops.group_key(group)
        loss = _ops.parallel_cross_entropy(
            parallel_logits, labels, float(label_smoothing), ignore_index, key
        )[0]
    elif tp == 1 and smoothing <= 1.0:  # the whole vocabulary is here: torch's fused kernel
        loss = F.cross_entropy(
            parallel_logits.float().reshape(-1, parallel_logits.shape[-1]),
            labels.reshape(-1),
            reduction="none",
            ignore_index=ignore_index,
            label_smoothing=smoothing,
        ).reshape(labels.shape)
    else:  # (also eps > (V - 1) / V on one rank: s > 1, which torch's kernel refuses)
        loss = _ParallelCrossEntropy.apply(
            parallel_logits, labels, float(label_smoothing), ignore_index, group
        )
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (labels != ignore_index).sum()
    return loss


def _log_z(z: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """log sum_c exp(z_c) over the whole (sharded) vocabulary, per token, float32."""
    z_max = z.max(dim=-1).values
    collectives.all_reduce(z_max, group=group, op=ReduceOp.MAX)
    sum_exp = (z - z_max.unsqueeze(-1)).exp().sum(dim=-1)
    collectives.all_reduce(sum_exp, group=group)
    return sum_exp.log() + z_max


class _ParallelLogprob(torch.autograd.Function):
    """log p_t(y_t) = z_t,y_t - log Z_t for vocab-sharded z; backward onehot(y) - softmax(z)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup
    ) -> torch.Tensor:
        rank, local_vocab = collectives.group_rank(group), logits.shape[-1]
        start = rank * local_vocab
        z = logits.float()
        log_z = _log_z(z, group)
        outside = (target < start) | (target >= start + local_vocab)
        local = (target - start).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        collectives.all_reduce(picked, group=group)
        ctx.save_for_backward(z, log_z, local, outside)
        ctx.dtype = logits.dtype
        return picked - log_z

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        z, log_z, local, outside = ctx.saved_tensors
        grad_z = (z - log_z.unsqueeze(-1)).exp_().neg_()  # -softmax, local columns
        grad_z.scatter_add_(-1, local.unsqueeze(-1), (~outside).to(grad_z.dtype).unsqueeze(-1))
        grad_z.mul_(grad.unsqueeze(-1))
        return grad_z.to(ctx.dtype), None, None


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    inference: bool = True,
    *,
    tensor_parallel_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """log p(target[..., t+1] | logits[..., t, :]) for t < S-1, from vocab-sharded logits.

    ``vocab_parallel_logits``: ``(..., S, V / tp)``, this rank's vocabulary columns;
    ``target``: ``(..., S)``, unsharded, *unshifted* ids (shifted here, as NxD does). Returns
    ``(..., S - 1)`` float32 log-probabilities, equal to ``log_softmax(logits).gather(target)``
    on the gathered logits. ``inference=True`` (NxD's default) builds no autograd graph; pass
    ``inference=False`` to differentiate through it.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape or target.dim() < 1:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits shape without the "
            f"vocabulary dim, {tuple(vocab_parallel_logits.shape[:-1])}"
        )
    if target.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"target must be integer ids, got dtype {target.dtype}")
    group = resolve_tensor_parallel_group(tensor_parallel_group)
    shifted = target.roll(shifts=-1, dims=-1)
    if inference:
        with torch.no_grad():
            logprobs = _ParallelLogprob.apply(vocab_parallel_logits, shifted, group)
    else:
        logprobs = _ParallelLogprob.apply(vocab_parallel_logits, shifted, group)
    return logprobs[..., :-1].contiguous()
