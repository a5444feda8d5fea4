"""The causal-LM loss on vocabulary-sharded logits (what ``model.loss_function`` becomes).

Hugging Face's ``ForCausalLMLoss``: labels shifted left by one (the last position gets
``ignore_index``), then the mean over non-ignored tokens of ``-log softmax(z_t)[y_{t+1}]``
(or the sum divided by ``num_items_in_batch``); a batch with no counted target has loss 0
and gradient 0 where transformers' mean is 0/0 = NaN. Here ``z`` holds this rank's columns of the
vocabulary (``ColumnParallelLinear`` without gather), and ``parallel_cross_entropy`` reduces
the softmax's max, normaliser and target logit over TP as per-token scalars: the
``(B, S, V)`` logits are never gathered. Columns past the real vocabulary (padding to a
multiple of TP) are set to ``-inf``, so they get probability 0 and no gradient.

With context parallelism at PP > 1 (:attr:`ParallelCausalLMLoss.context_parallel_pipeline`,
set by ``nxd_trainer._context_parallel.enable_context_parallel``) the loss is that module's
``pipeline_loss`` on sharded logits: ``shift_labels`` holds this CP rank's ``S_r`` targets,
``labels`` the whole sequence's ``S`` shifted ones, and ``L_r = (S/S_r) Σ_{t∈r} ℓ_t / N`` with
``N`` the counted targets of ``labels``: its mean over CP is the micro-batch's token mean.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nxd_state

__all__ = ["ParallelCausalLMLoss"]


class ParallelCausalLMLoss(nn.Module):
    """``loss_function(logits, labels, vocab_size, num_items_in_batch=None,
    ignore_index=-100, shift_labels=None)`` on sharded logits (see the module docstring)."""

    vocab_limit: torch.Tensor

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # The vocabulary size as a buffer the forward reads: a module without tensors is left
        # out of the pipeline's torch.export graph, which must keep this one as a call.
        self.register_buffer("vocab_limit", torch.tensor(vocab_size), persistent=False)
        self.context_parallel_pipeline = False

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        from nxd_layers import parallel_cross_entropy

        logits = logits.float()  # (B, S, V_local), as Hugging Face upcasts
        local = logits.shape[-1]
        start = nxd_state.get_tensor_model_parallel_rank() * local
        columns = torch.arange(start, start + local, device=logits.device)
        logits = logits.masked_fill(columns >= self.vocab_limit, float("-inf"))  # padding
        if self.context_parallel_pipeline:  # see the module docstring
            if shift_labels is None:
                raise ValueError(
                    "context parallelism with pipeline parallelism: the last stage got no "
                    "shift_labels (this rank's slice of the shifted labels)"
                )
            total = parallel_cross_entropy(
                logits, shift_labels.to(logits.device).contiguous(), ignore_index=ignore_index,
                reduction="sum",
            )  # fmt: skip
            count = (labels != ignore_index).sum().clamp(min=1)  # none counted: 0, not 0/0
            return total * (labels.shape[-1] / shift_labels.shape[-1]) / count
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device).contiguous()
        loss = parallel_cross_entropy(
            logits, shift_labels, ignore_index=ignore_index, reduction="sum"
        )
        if num_items_in_batch is None:  # the token mean; no counted target: 0, not 0/0
            num_items_in_batch = (shift_labels != ignore_index).sum().clamp(min=1)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch
