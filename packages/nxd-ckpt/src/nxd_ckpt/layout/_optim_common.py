"""What the optimizer checkpoint code needs to know about an optimizer, in one place.

Optimizer state is saved by *parameter name* as global tensors (``<name>/exp_avg``,
``<name>/master`` …), so it loads under any TP/PP/DP degrees and with ZeRO-1 on or off. This
module resolves an optimizer into one of two shapes:

* ``zero1``: an optimizer that describes its flat ZeRO-1 layout itself
  (:class:`nxd_state.shards.FlatShardedState`: nxd_optim's ``NeuronZero1Optimizer``,
  ``NeuronEPZero1Optimizer``, ``NxDOptimizer`` wrapping one; :mod:`nxd_optim.checkpoint_layout`).
  Each of its groups (:attr:`OptimizerView.zeros`: the optimizer itself, or the two halves of
  an EP-aware one) holds flat buckets: the bucket's params p_1 … p_k lie end to end in a flat
  vector zero-padded to n·S elements (S = ceil(Σ numel / n)), rank r holds elements
  [rS, (r+1)S) as its master shard, and the inner optimizer keeps state tensors shaped like
  that shard. A rank's shard is a range of vec(local param), and the param's spec places it
  in the global tensor (an expert param's experts at rows [q E/EP, (q+1) E/EP) on EP rank q),
  so the state is stored as at EP = 1 and every shard is written by its owner.
* ``plain``: any ``torch.optim`` optimizer, or an optimizer wrapper whose inner optimizer
  steps fp32 master copies of low-precision params
  (:class:`nxd_state.shards.MasterWeightsState`: ``NxDOptimizer`` without ZeRO-1), its masters
  checked by :func:`checked_masters`.

Parameter names come from the model; without a model, ``pp<r>.group<i>.<j>`` positions. A
parameter whose module declares stored parts (:mod:`nxd_ckpt.parts`) has its state stored
under the parts' names, each part's blocks cut from the parameter's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt.layout._context import RankContext
from nxd_ckpt.layout._model_tensors import LocalTensor, model_tensors
from nxd_layers.checkpoint_shards import tensor_shard_spec
from nxd_state.shards import (
    FlatBucket,
    FlatShardedState,
    FlatShardGroup,
    MasterWeightsLayout,
    MasterWeightsState,
    ShardSpec,
)

__all__ = [
    "FlatPiece",
    "OptimizerView",
    "ZeroBucket",
    "checked_masters",
    "flat_pieces",
    "resolve_optimizer",
    "zero1_parts",
]

MASTER_KEY = "master"


@dataclass(frozen=True)
class FlatPiece:
    """Elements ``[param_start, +numel)`` of vec(p_index) sit at ``[shard_start, +numel)``."""

    index: int
    param_start: int
    shard_start: int
    numel: int


def flat_pieces(shapes: list[tuple[int, ...]], num_shards: int, rank: int) -> list[FlatPiece]:
    """Which slice of which parameter lands in shard ``rank`` (padding excluded); a param
    with nothing in this shard gets a zero-length piece, so every param is listed."""
    numels = [math.prod(shape) for shape in shapes]
    shard = -(-sum(numels) // num_shards)
    lo, hi = rank * shard, (rank + 1) * shard
    out, start = [], 0
    for index, numel in enumerate(numels):
        begin, end = max(lo, start), min(hi, start + numel)
        if begin < end:
            out.append(FlatPiece(index, begin - start, begin - lo, end - begin))
        else:
            out.append(FlatPiece(index, 0, 0, 0))
        start += numel
    return out


ZeroBucket = FlatBucket
"""nxd-ckpt's old name of :class:`nxd_state.shards.FlatBucket`."""


def zero1_parts(zeros: list[FlatShardGroup]) -> list[tuple[torch.optim.Optimizer, FlatBucket]]:
    """(inner optimizer, bucket) of every flat bucket of the ZeRO-1 groups ``zeros``."""
    return [(group.inner, bucket) for group in zeros for bucket in group.buckets]


def checked_masters(layout: MasterWeightsLayout) -> dict[torch.Tensor, torch.Tensor]:
    """``{model param: fp32 master}`` of an optimizer wrapper without ZeRO-1
    (:class:`nxd_state.shards.MasterWeightsState`: low-precision params stepped through fp32
    copies), checked to be what the saved layout assumes: same-shaped floating-point tensors
    the inner optimizer steps."""
    stepped = {id(p) for group in layout.inner.param_groups for p in group["params"]}
    for param, master in layout.masters.items():
        if (
            not isinstance(master, torch.Tensor)
            or not master.is_floating_point()
            or tuple(master.shape) != tuple(param.shape)
            or id(master) not in stepped
        ):
            raise RuntimeError(
                f"the optimizer's master_checkpoint_layout() maps a parameter of shape "
                f"{tuple(param.shape)} to {type(master).__name__} "
                f"{tuple(getattr(master, 'shape', ()))}, which is not a same-shaped "
                f"floating-point master stepped by the inner optimizer"
            )
    return layout.masters


@dataclass
class OptimizerView:
    """An optimizer resolved for checkpointing (see the module docstring)."""

    kind: str
    optimizer: Any
    """The object whose state_dict / load_state_dict are used."""
    inner: torch.optim.Optimizer | None = None
    """``plain``: the optimizer holding per-parameter state."""
    model_param: dict[int, torch.Tensor] = field(default_factory=dict)
    """``plain``: id(inner param) -> the model parameter it stands for (fp32 masters)."""
    masters_in_ckpt: bool = False
    zeros: list[FlatShardGroup] = field(default_factory=list)
    """``zero1``: the ZeRO-1 groups whose flat buckets hold the state (the optimizer itself,
    or the two halves of a ``NeuronEPZero1Optimizer``); ``optimizer`` holds the caller's
    param groups."""
    flat_class: str = ""
    """``zero1``: the inner optimizer's class name, as the flat layout says."""
    names: dict[int, str] = field(default_factory=dict)
    """id(model param) -> name."""
    tensors: dict[str, LocalTensor] = field(default_factory=dict)
    """name -> the parameter as the model describes it (spec, stored parts)."""
    targets: dict[str, list[tuple[str, ShardSpec]]] = field(default_factory=dict)
    """name -> (stored name, spec) of each tensor its state is stored as: what a save
    writes; a load sets what the checkpoint holds (:meth:`match`)."""

    def stored(self, name: str) -> list[tuple[str, ShardSpec]]:
        return self.targets[name]

    def stored_names(self, names: list[str]) -> list[str]:
        """The stored names of parameters ``names``, in order."""
        return [stored for name in names for stored, _ in self.targets[name]]

    def match(self, saved: set[str]) -> None:
        """Read each parameter's state from the stored names a checkpoint holding ``saved``
        has (its parts, or its own name: :meth:`LocalTensor.stored_in`)."""
        self.targets = {name: t.stored_in(saved) for name, t in self.tensors.items()}

    @property
    def class_name(self) -> str:
        if self.kind == "zero1":
            return self.flat_class
        assert self.inner is not None
        return type(self.inner).__name__

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups over the model's parameters (``plain``: the inner optimizer's)."""
        if self.kind == "zero1":
            return self.optimizer.param_groups
        assert self.inner is not None
        return self.inner.param_groups

    def name_of(self, param: torch.Tensor) -> str:
        try:
            return self.names[id(param)]
        except KeyError:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not a "
                f"parameter of the model passed to the checkpoint call: optimizer state is "
                f"saved by parameter name"
            ) from None

    def model_params_of_group(self, group: dict[str, Any]) -> list[torch.Tensor]:
        return [self.model_param.get(id(p), p) for p in group["params"]]


def _param_names(
    model: Any,
    optimizer_params: list[torch.Tensor],
    ctx: RankContext,
    walked: list[LocalTensor] | None,
) -> tuple[dict[int, str], dict[str, LocalTensor]]:
    names: dict[int, str] = {}
    described: dict[str, LocalTensor] = {}
    if model is not None:
        tensors = walked if walked is not None else model_tensors(model, ctx)[0]
        for local in tensors:
            names.setdefault(id(local.tensor), local.name)
            described[local.name] = local
        return names, described
    for index, param in enumerate(optimizer_params):  # positions: same layout only
        name = f"pp{ctx.pp_rank}.param{index}"
        names[id(param)] = name
        spec = tensor_shard_spec(
            param,
            tp_rank=ctx.tp_rank,
            tp_size=ctx.tp_size,
            ep_rank=ctx.ep_rank,
            ep_size=ctx.ep_size,
            local_name=name,
        )
        described[name] = LocalTensor(name, param, spec)
    return names, described


def _view(kind: str, optimizer: Any, names: dict, tensors: dict, **rest: Any) -> OptimizerView:
    targets = {name: local.stored() for name, local in tensors.items()}
    return OptimizerView(kind, optimizer, names=names, tensors=tensors, targets=targets, **rest)


def resolve_optimizer(
    optimizer: Any, model: Any, ctx: RankContext, *, walked: list[LocalTensor] | None = None
) -> OptimizerView:
    """Classify ``optimizer`` and name its parameters from ``model`` (from ``walked``, the
    model's tensors as :func:`~nxd_ckpt.layout._model_tensors.model_tensors` returned them, when
    the caller has walked the model already: a save walks it once)."""
    layout = (
        optimizer.flat_checkpoint_layout(ctx) if isinstance(optimizer, FlatShardedState) else None
    )
    if layout is not None:
        core = layout.optimizer
        params = [p for group in core.param_groups for p in group["params"]]
        names, tensors = _param_names(model, params, ctx, walked)
        return _view(
            "zero1",
            core,
            names,
            tensors,
            zeros=list(layout.groups),
            masters_in_ckpt=layout.masters_in_checkpoint,
            flat_class=layout.optimizer_class,
        )
    wrapper = optimizer if isinstance(optimizer, MasterWeightsState) else None
    masters_layout = wrapper.master_checkpoint_layout() if wrapper is not None else None
    core = masters_layout.inner if masters_layout is not None else optimizer
    if not isinstance(core, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, an nxd_optim.NxDOptimizer or a "
            f"NeuronZero1Optimizer, got {type(optimizer).__name__}"
        )
    model_param: dict[int, torch.Tensor] = {}
    masters_in_ckpt = False
    if masters_layout is not None:
        masters = checked_masters(masters_layout)
        model_param = {id(master): param for param, master in masters.items()}
        masters_in_ckpt = bool(masters) and masters_layout.masters_in_checkpoint
    inner_params = [p for group in core.param_groups for p in group["params"]]
    names, tensors = _param_names(
        model, [model_param.get(id(p), p) for p in inner_params], ctx, walked
    )
    return _view(
        "plain",
        wrapper if wrapper is not None else core,
        names,
        tensors,
        inner=core,
        model_param=model_param,
        masters_in_ckpt=masters_in_ckpt,
    )


def encode_scalar(value: Any, where: str) -> dict[str, Any]:
    """A non-tensor-shaped state value (``step``) as JSON."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"optimizer state {where} is a tensor of shape {tuple(value.shape)} that is not "
                f"shaped like its parameter: it cannot be saved by parameter name"
            )
        return {
            "value": value.item(),
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
        }
    if isinstance(value, (bool, int, float)) or value is None:
        return {"value": value}
    raise TypeError(f"optimizer state {where} is a {type(value).__name__}: not supported")


def decode_scalar(encoded: dict[str, Any]) -> Any:
    if "dtype" in encoded:
        dtype = getattr(torch, encoded["dtype"])
        return torch.tensor(encoded["value"], dtype=dtype).reshape(encoded.get("shape", []))
    return encoded["value"]
