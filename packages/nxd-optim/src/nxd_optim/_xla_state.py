"""torch-xla's ZeRO-1 state dict (what NxD's NeuronZero1Optimizer saves), read into nxd's layout.

torch-xla shards every parameter on its own: p of shape (d0, …) is zero-padded along dim 0 to
a multiple of n and rank r holds rows [r·c, (r+1)·c), c = ⌈d0/n⌉. Its ``state_dict()`` is

    {"state": {}, "param_groups": [{…, "params": [ids]}],
     "base_state": {i: {"step": t, "exp_avg": (c, …), …}},   the inner optimizer's, per param
     "shape_info": {i: shape},
     "sharded_master_weights": {i: (c, …)}}                   with save_master_weights

with params numbered across groups. Loading it is collective over the sharding group: every
rank brings its own rank's dict; per param and state key the row blocks are all-gathered and
unpadded, Σ_r rows_r[:d0] = the full tensor, and the result is loaded as a full state dict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nxd_state import collectives

if TYPE_CHECKING:
    from nxd_optim._zero1_base import Zero1Setup

__all__ = ["is_xla_state_dict", "xla_state_to_full"]


def is_xla_state_dict(state_dict: dict[str, Any]) -> bool:
    return "base_state" in state_dict and "shape_info" in state_dict


def _check(opt: Zero1Setup, state_dict: dict[str, Any]) -> list[torch.Tensor]:
    """The params, after checking the dict describes them (on every rank, before any
    collective)."""
    params = opt._all_params()
    shapes = {int(i): tuple(shape) for i, shape in state_dict["shape_info"].items()}
    mine = {i: tuple(p.shape) for i, p in enumerate(params)}
    if shapes != mine:
        raise ValueError(
            f"torch-xla ZeRO-1 state dict has param shapes {shapes}, this optimizer holds {mine}"
        )
    saved_sizes = [len(group["params"]) for group in state_dict["param_groups"]]
    sizes = [len(group["params"]) for group in opt.param_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"torch-xla ZeRO-1 state dict has param groups of sizes {saved_sizes}, this "
            f"optimizer has {sizes}"
        )
    if any(p.dim() == 0 for p in params):
        raise ValueError("torch-xla ZeRO-1 state dicts cannot hold 0-dim params (it pads dim 0)")
    return params


def _unshard(opt: Zero1Setup, rows: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full tensor from this rank's row block of ``param`` (collective)."""
    full = collectives.all_gather(rows.to(param.device).contiguous(), opt.sharding_group, dim=0)
    return full[: param.shape[0]].clone()


def _is_row_block(value: Any, param: torch.Tensor, n: int) -> bool:
    rows = -(-param.shape[0] // n)
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == param.dim()
        and value.shape[0] == rows
        and value.shape[1:] == param.shape[1:]
    )


def xla_state_to_full(
    opt: Zero1Setup, state_dict: dict[str, Any]
) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
    """This rank's torch-xla ZeRO-1 state dict as a full (unsharded) optimizer state dict, and
    the full master weights in param order when it saved them (collective over the sharding
    group: every rank brings its own rank's dict)."""
    params = _check(opt, state_dict)
    n = opt.sharding_size
    base_state = {int(i): entry for i, entry in state_dict["base_state"].items()}
    full_state: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(params):  # the same order on every rank: gathers pair up
        entry: dict[str, Any] = {}
        for key, value in sorted(base_state.get(index, {}).items()):
            if key != "step" and _is_row_block(value, param, n):
                entry[key] = _unshard(opt, value, param)
            else:
                entry[key] = value
        if entry:
            full_state[index] = entry
    full = {"state": full_state, "param_groups": state_dict["param_groups"]}
    masters = state_dict.get("sharded_master_weights")
    if not masters:
        return full, None
    masters = {int(i): rows for i, rows in masters.items()}
    return full, [_unshard(opt, masters[i], p) for i, p in enumerate(params)]
