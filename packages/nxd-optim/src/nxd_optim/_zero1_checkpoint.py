"""ZeRO-1 state dicts: the local shard, the gathered full state, and sharded files on disk.

The inner optimizer holds, per dtype bucket (one or more per param group), state tensors
shaped like the master shard (exp_avg, momentum_buffer …: "sharded" state) and scalars (step).
The full state dict splits the gathered sharded state back into one tensor per model
parameter, which is the form a plain optimizer over the model's parameters has, and what
allows a change of data-parallel size.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_optim._groups import current_state_or_none
from nxd_optim._state_io import read_state, write_state
from nxd_optim._xla_state import is_xla_state_dict, xla_state_to_full
from nxd_state import collectives

if TYPE_CHECKING:
    from nxd_optim._zero1_base import Zero1Setup

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "load_local_state_dict",
    "load_sharded",
    "local_state_dict",
    "save_sharded",
]

_SCALAR_KEYS = frozenset({"step"})


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _shard_meta(opt: Zero1Setup) -> dict[str, Any]:
    return {
        "sharding_size": opt.sharding_size,
        "sharding_rank": opt.sharding_rank,
        "shapes": [[list(p.shape) for p in group["params"]] for group in opt.param_groups],
        "dtypes": [[str(p.dtype) for p in group["params"]] for group in opt.param_groups],
        "optimizer_class": opt.optimizer_class.__name__,
    }


def _check_meta(opt: Zero1Setup, meta: dict[str, Any], source: str) -> None:
    if meta["sharding_size"] != opt.sharding_size:
        raise ValueError(
            f"{source} was saved by a ZeRO-1 optimizer sharded over {meta['sharding_size']} "
            f"ranks, but this one shards over {opt.sharding_size}: sharded state does not "
            f"reshard; save full_state_dict() and load it with load_full_state_dict() to change "
            f"the data-parallel size"
        )
    if meta["sharding_rank"] != opt.sharding_rank:
        raise ValueError(
            f"{source} holds shard {meta['sharding_rank']}, but this rank owns shard "
            f"{opt.sharding_rank}"
        )
    mine = _shard_meta(opt)
    for key in ("shapes", "dtypes"):
        if key in meta and meta[key] != mine[key]:  # files written before dtype buckets: shapes
            raise ValueError(
                f"{source} was saved for param {key} {meta[key]}, this optimizer holds {mine[key]}"
            )


def _bucket_ids(opt: Zero1Setup) -> list[list[int]]:
    """Per param group, the inner optimizer's param ids (one per dtype bucket)."""
    ids: list[list[int]] = [[] for _ in opt.param_groups]
    for index, bucket in enumerate(opt._buckets):
        ids[bucket.group_index].append(index)
    return ids


def _group_offsets(opt: Zero1Setup) -> list[int]:
    """Index of each group's first param when params are numbered across groups."""
    offsets, total = [], 0
    for group in opt.param_groups:
        offsets.append(total)
        total += len(group["params"])
    return offsets


def local_state_dict(opt: Zero1Setup) -> dict[str, Any]:
    inner = opt.base_optimizer.state_dict()
    out: dict[str, Any] = {
        "state": inner["state"],
        "param_groups": [_hyper(group) for group in opt.param_groups],
        "shard": _shard_meta(opt),
        "shape_info": {i: tuple(shape) for i, shape in opt.get_shape_info().items()},
    }
    if opt.use_master_weights_in_ckpt:
        out["master_weights"] = [bucket.master.detach().clone() for bucket in opt._buckets]
    return out


def load_local_state_dict(opt: Zero1Setup, state_dict: dict[str, Any]) -> None:
    if is_xla_state_dict(state_dict):  # NxD / torch-xla's per-param shards: collective
        _load_xla_state_dict(opt, state_dict)
        return
    _check_meta(opt, state_dict["shard"], "the state dict")
    groups = state_dict["param_groups"]
    opt.base_optimizer.load_state_dict(
        {
            "state": state_dict["state"],
            "param_groups": [
                {**_hyper(hyper), "params": ids} for hyper, ids in zip(groups, _bucket_ids(opt))
            ],
        }
    )
    for group, hyper in zip(opt.param_groups, groups):
        group.update(_hyper(hyper))
    if "master_weights" in state_dict:
        saved_masters = state_dict["master_weights"]
        if len(saved_masters) != len(opt._buckets):
            raise ValueError(
                f"the state dict holds {len(saved_masters)} master shards, this optimizer has "
                f"{len(opt._buckets)} dtype buckets"
            )
        with torch.no_grad():
            for bucket, saved in zip(opt._buckets, saved_masters):
                bucket.master.copy_(saved)
    else:
        opt.refresh_masters_from_params()


def _load_xla_state_dict(opt: Zero1Setup, state_dict: dict[str, Any]) -> None:
    """Load torch-xla's per-param shards: as a full state dict, then its master weights when
    it saved them (otherwise :func:`load_full_state_dict` rebuilt them from the params)."""
    full, full_masters = xla_state_to_full(opt, state_dict)
    load_full_state_dict(opt, full)
    if full_masters is None:
        return
    offsets = _group_offsets(opt)
    with torch.no_grad():
        for bucket in opt._buckets:
            values = [full_masters[offsets[bucket.group_index] + i] for i in bucket.positions]
            flat = bucket.layout.flatten(values, bucket.master.dtype, bucket.master.device)
            bucket.master.copy_(bucket.layout.shard(flat, opt.sharding_rank))
    opt.allgather_weights_and_update_full_parameter()  # params <- masters, as torch-xla does


def full_state_dict(opt: Zero1Setup) -> dict[str, Any]:
    offsets = _group_offsets(opt)
    state: dict[int, dict[str, Any]] = {}
    inner_state = opt.base_optimizer.state
    for bucket in opt._buckets:
        layout, master = bucket.layout, bucket.master
        shard_state = inner_state.get(master, {})
        per_param: list[dict[str, Any]] = [{} for _ in bucket.positions]
        for key in sorted(shard_state):  # same order on every rank: the gathers pair up
            value = shard_state[key]
            if isinstance(value, torch.Tensor) and value.shape == master.shape:
                full = collectives.all_gather(value.detach(), opt.sharding_group)
                for entry, start, numel, shape in zip(
                    per_param, layout.offsets, layout.numels, layout.shapes
                ):
                    entry[key] = full[start : start + numel].view(shape).clone()
            else:
                for entry in per_param:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for position, entry in zip(bucket.positions, per_param):
            if entry:
                state[offsets[bucket.group_index] + position] = entry
    groups_out = [
        {**_hyper(group), "params": list(range(start, start + len(group["params"])))}
        for group, start in zip(opt.param_groups, offsets)
    ]
    return {"state": state, "param_groups": groups_out}


def load_full_state_dict(opt: Zero1Setup, state_dict: dict[str, Any]) -> None:
    groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in opt.param_groups]
    if [len(g["params"]) for g in groups] != sizes:
        raise ValueError(
            f"full state dict has param groups of sizes {[len(g['params']) for g in groups]}, "
            f"this optimizer has {sizes}"
        )
    inner_state: dict[int, dict[str, Any]] = {}
    for index, bucket in enumerate(opt._buckets):
        saved_ids = groups[bucket.group_index]["params"]
        per_param = [state_dict["state"].get(saved_ids[pos], {}) for pos in bucket.positions]
        layout, master = bucket.layout, bucket.master
        entry: dict[str, Any] = {}
        for key in sorted({key for states in per_param for key in states}):
            values = [states.get(key) for states in per_param]
            sharded = key not in _SCALAR_KEYS and all(
                isinstance(v, torch.Tensor) and v.shape == shape
                for v, shape in zip(values, layout.shapes)
            )
            if sharded:
                flat = layout.flatten(values, values[0].dtype, master.device)
                entry[key] = layout.shard(flat, opt.sharding_rank).clone()
            else:  # a copy: the inner optimizer updates its state in place
                first = values[0]
                entry[key] = first.clone() if isinstance(first, torch.Tensor) else first
        if entry:
            inner_state[index] = entry
    opt.base_optimizer.load_state_dict(
        {
            "state": inner_state,
            "param_groups": [
                {**_hyper(g), "params": ids} for g, ids in zip(groups, _bucket_ids(opt))
            ],
        }
    )
    for group, saved in zip(opt.param_groups, groups):
        group.update(_hyper(saved))
    opt.refresh_masters_from_params()


def _shard_prefix(opt: Zero1Setup, output_dir: Path, dp: int | str) -> Path:
    state = current_state_or_none()
    tp = state.tensor_parallel_rank if state else 0
    pp = state.pipeline_parallel_rank if state else 0
    dp_part = f"{dp:02d}" if isinstance(dp, int) else dp
    return output_dir / f"zero1_optim.tp{tp:02d}.pp{pp:02d}.dp{dp_part}"


def save_sharded(opt: Zero1Setup, output_dir: Path, *, save_serially: bool) -> None:
    prefix = _shard_prefix(opt, output_dir, opt.sharding_rank)
    state = local_state_dict(opt)
    meta = state.pop("shard")
    if save_serially:  # one rank of the sharding group at a time (bounded host memory)
        for turn in range(opt.sharding_size):
            if turn == opt.sharding_rank:
                write_state(state, prefix, meta)
            collectives.barrier(opt.sharding_group)
    else:
        write_state(state, prefix, meta)
        collectives.barrier(opt.sharding_group)


def load_sharded(opt: Zero1Setup, output_dir: Path, num_workers_per_step: int) -> None:
    if num_workers_per_step < 1:
        raise ValueError(f"num_workers_per_step must be >= 1, got {num_workers_per_step}")
    pattern = _shard_prefix(opt, output_dir, "*").name + ".json"
    found = sorted(output_dir.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no ZeRO-1 optimizer shards matching {pattern} in {output_dir}")
    if len(found) != opt.sharding_size:
        raise ValueError(
            f"{output_dir} holds {len(found)} ZeRO-1 shards ({pattern}) but this optimizer shards "
            f"over {opt.sharding_size} ranks: load_sharded_state_dict does not reshard; load a "
            f"full state dict (load_full_state_dict) to change the data-parallel size"
        )
    prefix = _shard_prefix(opt, output_dir, opt.sharding_rank)
    for start in range(0, opt.sharding_size, num_workers_per_step):
        if start <= opt.sharding_rank < start + num_workers_per_step:
            state, meta = read_state(prefix)
            load_local_state_dict(opt, {**state, "shard": meta})
        collectives.barrier(opt.sharding_group)
