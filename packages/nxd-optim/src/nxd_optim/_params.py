"""What an optimizer's ``params`` argument may be: tensors, or param-group dicts."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["as_param_groups"]


def as_param_groups(params: Any, where: str) -> list[dict[str, Any]]:
    """``params`` (tensors or param-group dicts) as a list of groups; empty input is an error."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{where}: params must be an iterable of tensors or dicts, got a tensor")
    items = list(params)
    if not items:
        raise ValueError(
            f"{where} got an empty parameter list: pass model.parameters() or param groups "
            f"with at least one parameter"
        )
    groups = [dict(item) if isinstance(item, dict) else None for item in items]
    if all(group is None for group in groups):
        return [{"params": items}]
    if any(group is None for group in groups):
        raise TypeError(f"{where}: params mixes tensors and param-group dicts")
    for index, group in enumerate(groups):
        assert group is not None
        group["params"] = (
            [group["params"]]
            if isinstance(group["params"], torch.Tensor)
            else (list(group["params"]))
        )
        if not group["params"]:
            raise ValueError(f"{where}: param group {index} has an empty 'params' list")
    return groups  # type: ignore[return-value]
