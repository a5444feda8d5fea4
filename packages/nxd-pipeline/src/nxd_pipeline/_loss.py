"""The loss in a model's output, per NxD's ``output_loss_value_spec``.

The spec mirrors the output's structure with booleans: ``True`` marks the loss, ``False`` the
rest. ``True`` alone means the output *is* the loss tensor; ``(True, False)`` a tuple whose first
element is the loss; ``{"loss": True, "logits": False}`` a mapping (Hugging Face ``ModelOutput``
included); containers nest. As in NxD, the first value marked ``True`` (depth first, in the
spec's order) is the loss. Beyond NxD, a mapping spec may omit keys the output lacks when
they are marked ``False``, and a tuple spec also matches a ``ModelOutput`` (by position).

``None`` (nxd's default; NxD requires a spec) finds the loss itself: a tensor output, a
``loss`` key or attribute, or the first element of a tuple.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LossSpec", "check_loss_spec", "select_loss"]

LossSpec = bool | tuple[Any, ...] | list[Any] | dict[str, Any] | None


def check_loss_spec(spec: LossSpec) -> None:
    """Raise early (at construction, on every rank) for a spec that can never select a loss."""
    if spec is None:
        return
    if not _marks_loss(spec):
        raise ValueError(
            f"output_loss_value_spec={spec!r} marks no value True: mark the loss with True, "
            f"e.g. True (the output is the loss), (True, False) or {{'loss': True}}"
        )


def _marks_loss(spec: Any) -> bool:
    if isinstance(spec, bool):
        return spec
    if isinstance(spec, (tuple, list)):
        return any(_marks_loss(s) for s in spec)
    if isinstance(spec, dict):
        return any(_marks_loss(s) for s in spec.values())
    raise TypeError(
        f"output_loss_value_spec entries must be bools, tuples, lists or dicts; got "
        f"{type(spec).__name__} {spec!r}"
    )


def _as_sequence(output: Any) -> tuple[Any, ...] | None:
    if isinstance(output, (tuple, list)):
        return tuple(output)
    to_tuple = getattr(output, "to_tuple", None)  # transformers' ModelOutput
    return tuple(to_tuple()) if callable(to_tuple) else None


def _find(output: Any, spec: Any, path: str) -> torch.Tensor | None:
    """The first value of ``output`` marked True by ``spec``, or None if none is."""
    if spec is False:
        return None
    if spec is True:
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"output_loss_value_spec marks {path} as the loss, but it is a "
                f"{type(output).__name__}, not a tensor"
            )
        return output
    if isinstance(spec, (tuple, list)):
        items = _as_sequence(output)
        if items is None or len(items) < len(spec):
            raise TypeError(
                f"output_loss_value_spec {spec!r} expects {path} to be a tuple or list of at "
                f"least {len(spec)} values, got {type(output).__name__}"
                + (f" of {len(items)}" if items is not None else "")
            )
        for i, (item, flag) in enumerate(zip(items, spec)):
            found = _find(item, flag, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if not isinstance(output, Mapping):
        raise TypeError(
            f"output_loss_value_spec {spec!r} expects {path} to be a mapping, got "
            f"{type(output).__name__}"
        )
    for key, flag in spec.items():
        if key in output:
            found = _find(output[key], flag, f"{path}[{key!r}]")
            if found is not None:
                return found
        elif _marks_loss(flag):
            raise KeyError(
                f"output_loss_value_spec marks {path}[{key!r}] as the loss, but the output has "
                f"only the keys {list(output.keys())}"
            )
    return None


def _auto(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(
        f"cannot find the loss in a {type(output).__name__} output: pass "
        f"output_loss_value_spec, e.g. True, (True, False) or {{'loss': True}}"
    )


def select_loss(output: Any, spec: LossSpec) -> torch.Tensor:
    """The scalar loss in ``output`` per ``spec`` (see the module docstring)."""
    loss = _auto(output) if spec is None else _find(output, spec, "the output")
    if loss is None:
        raise ValueError(f"output_loss_value_spec {spec!r} marks no value of the output True")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"the selected loss must be a scalar tensor, got {shape}")
    return loss
