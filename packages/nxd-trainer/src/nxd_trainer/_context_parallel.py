"""Context parallelism for a Hugging Face causal LM: its batches split over the sequence, its
attention over the whole sequence, its loss the whole sequence's mean.

With ``n`` context-parallel ranks each holds ``S/n`` tokens of every sequence (ring: the zigzag
split, chunks ``r`` and ``2n-1-r`` of ``2n``; all-to-all: the ``r``-th contiguous ``1/n``),
with their global positions (rotary embeddings by global position). Labels are shifted to the
next token *before* the split (``shift_labels``), so a rank's last token still has its target.
The loss of one process is the mean over the ``N`` counted tokens of the whole sequence,
``L = (1/N) Σ_t ℓ_t``; rank ``r`` returns ``L_r = (n/N) Σ_{t ∈ r} ℓ_t`` (``num_items_in_batch
= N/n``: a sum divided by it), so that

    (1/n) Σ_r L_r = L    and    (1/n) Σ_r ∇L_r = ∇L,

the mean over CP that the optimizer wrapper's DP x CP gradient average and the trainer's loss
report take. ``N`` is counted on the whole (unsplit) labels every CP rank holds: no collective.
A batch (micro-batch) with no counted target (``N = 0``) has loss 0 and gradient 0: ``N`` is
taken as 1 there, where one process's mean would be 0/0 = NaN.

At PP > 1 the pipeline splits each batch into micro-batches and averages their losses, so
``N`` must be each micro-batch's count, known only after that split: the stages get
``input_ids``, ``position_ids`` and ``shift_labels`` (this rank's slices) and, as ``labels``,
the whole sequence's *shifted* labels (every CP rank holds them), from which the last stage's
loss (:func:`pipeline_loss`, installed as the model's ``loss_function``; at TP > 1 the
vocabulary-parallel loss of :mod:`nxd_trainer.hf._loss`, switched to the same formula)
counts ``N``:

    L_r = (S / S_r) (1/N) Σ_{t ∈ r} ℓ_t,    N = #{t : labels_t ≠ ignore},  S / S_r = n,

shapes and labels only, so the captured stage graph holds no constant of the CP degree.

Attention: the parallelised attention forward (:mod:`nxd_trainer.hf._attention`) calls
:func:`nxd_layers.context_parallel.ring_attention` or ``all_to_all_attention`` on this rank's
queries and keys (the K/V heads, not repeated) when :func:`enable_context_parallel` marked it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nxd_state

__all__ = [
    "ALGORITHMS",
    "check_context_parallel_model",
    "enable_context_parallel",
    "pipeline_input_names",
    "pipeline_loss",
    "split_context_parallel_inputs",
    "split_pipeline_inputs",
]

ALGORITHMS = ("ring", "all_to_all")
"""``NxDConfig.context_parallel_algorithm`` values (nxd-train spells the second ``all-to-all``)."""

# Inputs split along the sequence; anything else that is a tensor is refused (nxd cannot know
# which of its dimensions is the sequence).
_SPLIT = ("input_ids", "inputs_embeds", "position_ids")
_KNOWN = (*_SPLIT, "labels", "shift_labels", "attention_mask", "num_items_in_batch")


def zigzag_for(algorithm: str) -> bool:
    """The ring balances causal work with the zigzag split; all-to-all splits contiguously."""
    return algorithm == "ring"


def check_sequence_length(seq_len: int, cp: int, algorithm: str) -> None:
    """``seq_len`` splits exactly over ``cp`` ranks (``2·cp`` chunks for the ring), else a
    ``ValueError`` naming both values."""
    chunks = 2 * cp if zigzag_for(algorithm) else cp
    if seq_len % chunks:
        why = (
            f"2 x context_parallel_size({cp}) = {chunks} (the ring's zigzag split)"
            if zigzag_for(algorithm)
            else f"context_parallel_size({cp})"
        )
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {why}; use a sequence length that "
            f"is a multiple of {chunks}"
        )


def check_heads(heads: int, kv_heads: int, cp: int, algorithm: str, tp: int = 1) -> None:
    """All-to-all splits this rank's ``heads`` query and ``kv_heads`` K/V heads (after TP) over
    ``cp`` ranks: both must divide, else a ``ValueError`` naming the values."""
    if algorithm != "all_to_all":
        return
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n % cp:
            per = f" per tensor-parallel rank (tp={tp})" if tp > 1 else ""
            raise ValueError(
                f"all-to-all context parallelism splits heads over context_parallel_size({cp}), "
                f"but the model has {n} {what}{per}, not divisible by it; use the ring "
                f"algorithm, or a context-parallel degree dividing {n}"
            )


def check_context_parallel_model(model: nn.Module, config: Any) -> Any:
    """``model`` is a Hugging Face causal LM of a registered family (the rebuilt attention
    forward, which the context-parallel attention replaces exactly); returns its parallelizer.
    ``config``: the :class:`~nxd_trainer.NxDConfig`."""
    from nxd_trainer._model_info import is_hf_model
    from nxd_trainer.hf import ParallelizersManager

    cp = config.context_parallel_size
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = ParallelizersManager.get_supported_model_types()
    if not is_hf_model(model) or model_type not in supported:
        raise ValueError(
            f"context_parallel_size={cp} needs a Hugging Face causal LM of a family nxd "
            f"rebuilds the attention of ({supported}); got {type(model).__name__} (model_type "
            f"{model_type!r}): nxd cannot tell where such a model's sequence dimension and "
            f"attention are. Split the batch yourself with nxd_layers.context_parallel and "
            f"call context_parallel_attention in the model"
        )
    if not config.parallelize_hf_models:
        raise ValueError(
            f"context_parallel_size={cp} with parallelize_hf_models=False: the attention of "
            f"the model as returned would attend within each rank's slice only"
        )
    hf = model.config
    dropout = float(getattr(hf, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise ValueError(
            f"context_parallel_size={cp} with attention_dropout={dropout}: the context-parallel "
            f"attention has no dropout; set the model's attention_dropout to 0"
        )
    return ParallelizersManager.parallelizer_for_model(model)


def enable_context_parallel(
    model: nn.Module, parallelizer: Any, algorithm: str, pipelined: bool = False
) -> None:
    """Mark every attention module of ``model`` to attend over the whole sequence with
    ``algorithm``. At TP > 1 the parallelizer has swapped them already; at TP = 1 their class
    becomes ``Parallel<Class>`` (the same module and parameters, the rebuilt forward).
    ``pipelined`` (PP > 1): the model's loss becomes :func:`pipeline_loss`."""
    from nxd_trainer.hf._attention import ParallelAttentionMixin, parallel_attention_class
    from nxd_trainer.hf._swap import layout_for

    spec = parallelizer.spec
    tp = nxd_state.get_tensor_model_parallel_size()
    cp = nxd_state.get_parallel_state().context_parallel_size
    layout = layout_for(model.config, tp, None)
    check_heads(layout.local_heads, layout.local_kv_heads, cp, algorithm, tp)
    if tp == 1:
        parallelizer.inspect(model)  # the attention forward is one the mixin reproduces
    layers: Any = model.get_submodule(spec.layers)  # the decoder ModuleList
    for layer in layers:
        attn = layer.get_submodule(spec.attention)
        if not isinstance(attn, ParallelAttentionMixin):
            attn.__class__ = parallel_attention_class(type(attn))
            attn._nxd_qkv = (spec.q_proj, spec.k_proj, spec.v_proj)
            attn._nxd_o, attn._nxd_qk_norms = spec.o_proj, spec.qk_norms
        attn._nxd_cp_algorithm = algorithm
    hf_config: Any = model.config  # transformers' config (nn.Module's __getattr__ is untyped)
    hf_config.use_cache = False  # a KV cache is refused by the context-parallel attention
    if pipelined:
        from nxd_trainer.hf._loss import ParallelCausalLMLoss

        hf_model: Any = model  # transformers' PreTrainedModel: loss_function has a setter
        loss = hf_model.loss_function
        if isinstance(loss, ParallelCausalLMLoss):  # TP > 1: the logits are vocab-sharded
            loss.context_parallel_pipeline = True
        else:
            hf_model.loss_function = pipeline_loss


def check_right_padding(
    mask: torch.Tensor, shifted: torch.Tensor | None, ignore: int, shape: tuple[int, int]
) -> None:
    """Whether causal attention without ``mask`` gives exactly the loss and gradients that
    attention under it gives; a ``ValueError`` naming what breaks that if not.

    Right padding (each row ones, then zeros) is exact when no padded position predicts a
    counted target: a real token ``t`` attends to keys ``<= t``, all real, with or without the
    mask; a padded query's output differs (it also sees padding) but reaches no loss term, so
    the loss and every gradient are unchanged. Left padding or holes would let real tokens
    attend to padding, and a padded position with a counted target would change the loss."""
    keep = mask.bool()
    if bool(keep.all()):
        return
    if tuple(keep.shape) != shape:
        raise ValueError(
            f"context parallelism takes a (batch, sequence) = {shape} attention_mask of ones "
            f"and right padding; got one of shape {tuple(keep.shape)}"
        )
    if not bool((keep[:, 1:] <= keep[:, :-1]).all()):
        raise ValueError(
            "context parallelism takes right padding only (each attention_mask row ones, then "
            "zeros): this mask has a zero before a one (left padding or a hole), where real "
            "tokens would attend to padding; pad on the right or pack the sequences"
        )
    if shifted is None:
        raise ValueError(
            "context parallelism with a padded attention_mask needs the labels: it drops the "
            "mask, exact only when no padded position's output is counted"
        )
    if bool((shifted[~keep] != ignore).any()):
        raise ValueError(
            f"context parallelism with a padded attention_mask: some padded positions predict "
            f"a counted target; set the labels at padding to ignore_index ({ignore})"
        )


def _inputs_by_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inputs by name (one positional input is ``input_ids``); a tensor the split does not
    know is refused (nxd cannot know which of its dimensions is the sequence)."""
    if len(args) > 1:
        raise TypeError(
            "with context parallelism pass the model's inputs by name (input_ids=..., "
            f"labels=...); got {len(args)} positional inputs"
        )
    inputs = dict(kwargs)
    if args:
        if "input_ids" in inputs:
            raise TypeError("input_ids given both by position and by name")
        inputs["input_ids"] = args[0]
    unknown = sorted(k for k, v in inputs.items() if torch.is_tensor(v) and k not in _KNOWN)
    if unknown:
        raise ValueError(
            f"context parallelism splits {list(_KNOWN)} along the sequence; inputs "
            f"{unknown} would not be split: compute them inside the model, or use "
            f"context_parallel_size=1"
        )
    return inputs


def split_context_parallel_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], algorithm: str
) -> dict[str, Any]:
    """A causal LM's keyword inputs for this CP rank (see the module docstring): ``input_ids``
    (or ``inputs_embeds``) and ``position_ids`` split, ``labels`` shifted then split, the
    loss's ``num_items_in_batch`` set; an ``attention_mask`` dropped where
    :func:`check_right_padding` proves that exact, refused otherwise."""
    inputs = _inputs_by_name(args, kwargs)
    state = nxd_state.get_parallel_state()
    group, cp = state.context_parallel_group, state.context_parallel_size
    zigzag = zigzag_for(algorithm)
    ref = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if ref is None:
        raise ValueError("context parallelism needs input_ids or inputs_embeds (batch, sequence)")
    batch, seq_len = ref.shape[0], ref.shape[1]
    check_sequence_length(seq_len, cp, algorithm)
    mask = inputs.pop("attention_mask", None)
    from nxd_layers.context_parallel import (
        context_parallel_position_ids,
        split_for_context_parallel,
    )

    def split(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != seq_len:
            raise ValueError(
                f"inputs of sequence length {x.shape[1]} and {seq_len}: context parallelism "
                f"splits every input along the same sequence"
            )
        return split_for_context_parallel(x, group, dim=1, zigzag=zigzag)

    out = {k: v for k, v in inputs.items() if k not in (*_SPLIT, "labels", "shift_labels")}
    for key in _SPLIT:
        if inputs.get(key) is not None:
            out[key] = split(inputs[key])
    if inputs.get("position_ids") is None:
        out["position_ids"] = context_parallel_position_ids(
            seq_len, group, zigzag, batch, device=ref.device
        )
    labels, shifted = inputs.get("labels"), inputs.get("shift_labels")
    ignore = int(inputs.get("ignore_index", -100))
    if shifted is None and labels is not None:
        shifted = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    if mask is not None:
        check_right_padding(mask, shifted, ignore, (batch, seq_len))
    if shifted is not None:
        count = inputs.get("num_items_in_batch")
        if count is None:  # no counted target: L_r = 0, not 0/0
            count = (shifted != ignore).sum().clamp(min=1)
        local = split(shifted)
        out["labels"] = out["shift_labels"] = local
        out["num_items_in_batch"] = count / cp
    return out


# Pipeline parallelism -----------------------------------------------------------------------
_PIPELINE_ADDED = ("position_ids", "shift_labels")


def pipeline_input_names(names: list[str] | None) -> list[str]:
    """The inputs a pipeline stage graph is captured with at CP x PP: ``names`` (from
    ``pipeline_config["input_names"]``, which must hold ``labels``) without
    ``attention_mask`` (dropped where exact, refused otherwise, before the pipeline), with
    ``position_ids`` and ``shift_labels`` (see the module docstring)."""
    names = list(names or ())
    if "labels" not in names:
        raise ValueError(
            f"context parallelism with pipeline parallelism computes the loss in the last "
            f"stage from the labels: pipeline_config['input_names'] must hold 'labels', got "
            f"{names}"
        )
    kept = [n for n in names if n != "attention_mask"]
    return [*kept, *(n for n in _PIPELINE_ADDED if n not in kept)]


def split_pipeline_inputs(inputs: dict[str, Any], algorithm: str) -> dict[str, Any]:
    """The pipeline's inputs for this CP rank (the module docstring): the PP = 1 split, then
    ``labels`` replaced by the whole sequence's shifted labels and ``num_items_in_batch``
    dropped (the last stage counts each micro-batch's targets itself)."""
    if inputs.get("labels") is None and inputs.get("shift_labels") is None:
        raise ValueError("context parallelism with pipeline parallelism needs the labels")
    if inputs.get("num_items_in_batch") is not None:
        raise ValueError(
            "num_items_in_batch with context and pipeline parallelism: each micro-batch's "
            "loss is its own token mean, counted in the last stage; leave it out"
        )
    ignore = int(inputs.get("ignore_index", -100))
    shifted = inputs.get("shift_labels")
    if shifted is None:
        shifted = F.pad(inputs["labels"], (0, 1), value=ignore)[..., 1:]
    out = split_context_parallel_inputs((), inputs, algorithm)
    out.pop("num_items_in_batch")
    out["labels"] = shifted
    return out


def pipeline_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    **kwargs: Any,
) -> torch.Tensor:
    """This CP rank's loss of one micro-batch at PP > 1 (``transformers``' ``loss_function``
    signature): ``L_r = (S / S_r) Σ_{t ∈ r} ℓ_t / N`` with ``logits`` and ``shift_labels``
    this rank's ``S_r`` tokens and ``labels`` the whole sequence's ``S`` shifted labels, ``N``
    its counted ones (see the module docstring); ``ℓ`` is cross-entropy in fp32, as
    transformers' ``ForCausalLMLoss``."""
    del kwargs
    if shift_labels is None:
        raise ValueError(
            "context parallelism with pipeline parallelism: the last stage got no "
            "shift_labels (this rank's slice of the shifted labels)"
        )
    total = F.cross_entropy(
        logits.float().reshape(-1, vocab_size),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (labels != ignore_index).sum().clamp(min=1)  # none counted: 0, not 0/0
    return total * (labels.shape[-1] / shift_labels.shape[-1]) / count
