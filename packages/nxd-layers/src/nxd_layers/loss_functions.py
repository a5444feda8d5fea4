"""Cross entropy over vocabulary-sharded logits, never gathering the vocabulary.

loss_t = log sum_c exp(z_tc) - z_t,y_t, with label smoothing eps:
loss_t = (1 - eps) * (log Z_t - z_t,y_t) + eps * (log Z_t - mean_c z_tc),
exactly ``F.cross_entropy(..., reduction="none", label_smoothing=eps)``. Each rank holds the
columns ``[r V/p, (r+1) V/p)`` of z: the max, sum of exponentials, target logit and sum of
logits are reduced over TP as scalars per token (3 or 4 all-reduces of ``b·s`` floats).
Backward: dL/dz = softmax(z) - (1 - eps) onehot(y) - eps / V, local columns only.

:func:`from_parallel_logits_to_logprobs` gives log p(y_{t+1} | z_t) = z_t,y - log Z_t from the
same sharded logits (NxD's, for preference / RL losses), with dL/dz = (onehot(y) - softmax(z))
times the upstream gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup, ReduceOp

from nxd_layers._attributes import resolve_tensor_parallel_group
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
        rank, tp = collectives.group_rank(group), collectives.group_size(group)
        local_vocab = logits.shape[-1]
        vocab = local_vocab * tp
        z = logits.float()
        z_max = z.max(dim=-1).values
        collectives.all_reduce(z_max, group=group, op=ReduceOp.MAX)
        z = z - z_max.unsqueeze(-1)  # (..., V/p), <= 0: exp cannot overflow
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        collectives.all_reduce(sum_exp, group=group)

        start = rank * local_vocab
        ignored = labels == ignore_index
        outside = (labels < start) | (labels >= start + local_vocab) | ignored
        local_labels = (labels - start).masked_fill(outside, 0)
        target = z.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        collectives.all_reduce(target, group=group)

        log_z = sum_exp.log()
        loss = log_z - target
        if label_smoothing > 0:
            z_sum = z.sum(dim=-1)
            collectives.all_reduce(z_sum, group=group)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - z_sum / vocab)
        loss = loss.masked_fill(ignored, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, local columns
        ctx.save_for_backward(exp, local_labels, outside, ignored)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local_labels, outside, ignored = ctx.saved_tensors
        grad = softmax
        eps = ctx.label_smoothing
        onehot_scale = (~outside).to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -onehot_scale.unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


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
    are left out of the ``"mean"``, as in ``F.cross_entropy``). Returns float32.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
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
    if collectives.group_size(group) == 1:  # the whole vocabulary is here: torch's fused kernel
        loss = F.cross_entropy(
            parallel_logits.float().reshape(-1, parallel_logits.shape[-1]),
            labels.reshape(-1),
            reduction="none",
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
        ).reshape(labels.shape)
    else:
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
