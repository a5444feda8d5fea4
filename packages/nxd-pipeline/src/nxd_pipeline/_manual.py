"""NxD's manual partition mode: a model given as a list of layers, ``y = f_L(... f_1(x))``.

With ``manual_pp_partition=True`` no graph is captured. Layer ``i`` goes to stage ``stage_of[i]``
(``manual_pp_stage_partition_fn(layers, num_stages)``, or NxD's even split: ``n // S`` layers per
stage, the remainder on the last), stage ``s`` runs on pipeline rank ``s mod p``, and a stage
applies its layers in order, each to the previous one's output. As in NxD, the first layer
receives the list of this microbatch's input tensors (``run_train(inputs=x)`` gives it ``[x]``)
and, with ``manual_pp_loss_fn``, the last stage's loss is ``loss_fn(out[0], labels[0])``.

What crosses a stage boundary is the boundary layer's output: a tensor or a list/tuple of
tensors, delivered to the next stage in the same container. The container travels as a
zero-element marker tensor whose shape ``(0, kind)`` names it; p2p sends only its shape, in the
first-step header.

Parameters keep the names an ``nn.Sequential(*layers)`` would give them (``"3.weight"``).
Weights used by layers on several pipeline ranks (the same ``Parameter`` object, or marked with
:func:`mark_weight_sharing`) start from the lowest rank's value and have their gradients summed
over the pipeline group after each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from nxd_pipeline._loss import LossSpec, select_loss
from nxd_pipeline._materialize import materialize_local_parameters
from nxd_pipeline._shared import mark_weight_sharing

__all__ = [
    "ManualStage",
    "PipelineStageModule",
    "assign_stages",
    "build_manual_stages",
    "even_partition",
    "materialize_manual",
]

_KINDS = {1: "tensor", 2: "list", 3: "tuple"}


def even_partition(layers: Sequence[nn.Module], num_stages: int) -> dict[nn.Module, int]:
    """NxD's default: ``n // S`` consecutive layers per stage, the remainder on the last."""
    per_stage = len(layers) // num_stages
    if per_stage == 0:
        raise ValueError(
            f"{len(layers)} layers cannot fill {num_stages} pipeline stages: give at least "
            f"{num_stages} layers, or a manual_pp_stage_partition_fn"
        )
    return {layer: min(i // per_stage, num_stages - 1) for i, layer in enumerate(layers)}


def assign_stages(
    layers: Sequence[nn.Module],
    num_stages: int,
    partition_fn: Callable[[Sequence[nn.Module], int], dict[nn.Module, int]] | None = None,
) -> list[int]:
    """Stage of every layer, checked: each in range, in order along the list, none empty."""
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(
                f"manual_pp_partition takes a list of nn.Module layers; item {i} is a "
                f"{type(layer).__name__}"
            )
    mapping = (partition_fn or even_partition)(layers, num_stages)
    stages = []
    for i, layer in enumerate(layers):
        stage = mapping.get(layer)
        if not isinstance(stage, int) or not 0 <= stage < num_stages:
            raise ValueError(
                f"manual_pp_stage_partition_fn put layer {i} ({type(layer).__name__}) on stage "
                f"{stage!r}; expected an int in [0, {num_stages})"
            )
        stages.append(stage)
    if stages != sorted(stages) or set(stages) != set(range(num_stages)):
        raise ValueError(
            f"manual_pp_stage_partition_fn gave the stages {stages}: every stage 0..."
            f"{num_stages - 1} needs at least one layer, and stages must follow the layer order "
            f"(the pipeline runs layer i+1 after layer i)"
        )
    return stages


class PipelineStageModule(nn.Module):
    """The layers of one stage, applied in order (NxD's ``manual_pipe_stage`` class).

    ``PipelineStageModule(layers, num_stages, stage_index, partition_fn=None)`` keeps the layers
    ``partition_fn`` (default :func:`even_partition`) assigns to ``stage_index``, registered
    under their index in ``layers``. ``forward(x)`` returns ``f_j(... f_i(x))``.
    """

    mark_weight_sharing = staticmethod(mark_weight_sharing)

    def __init__(
        self,
        layers: Sequence[nn.Module],
        num_stages: int,
        stage_index: int,
        partition_fn: Callable[[Sequence[nn.Module], int], dict[nn.Module, int]] | None = None,
        *,
        stage_of: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"layers must be a list or tuple, got {type(layers).__name__}")
        self.num_stages = num_stages
        self.stage_index = stage_index
        self.partition_fn = partition_fn
        if stage_of is None:
            stage_of = assign_stages(layers, num_stages, partition_fn)
        self.layer_indices = [i for i, s in enumerate(stage_of) if s == stage_index]
        for i in self.layer_indices:
            self.add_module(str(i), layers[i])

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This stage's layers, in order."""
        return [self.get_submodule(str(i)) for i in self.layer_indices]

    def forward(self, x: Any) -> Any:
        for layer in self.stage_modules:
            x = layer(x)
        return x


def _pack(value: Any, stage: int) -> tuple[torch.Tensor, ...]:
    """A stage output as flat tensors plus the marker naming its container."""
    if isinstance(value, torch.Tensor):
        tensors, kind = [value], 1
    elif type(value) in (list, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        tensors, kind = list(value), 2 if type(value) is list else 3
    else:
        raise TypeError(
            f"pipeline stage {stage}'s last layer returned {_describe(value)}; in manual "
            f"partition mode only a tensor or a non-empty list/tuple of tensors can cross a "
            f"stage boundary: move the boundary (manual_pp_stage_partition_fn)"
        )
    marker = torch.empty((0, kind), device=tensors[0].device)
    return (*tensors, marker)


def _unpack(received: Sequence[torch.Tensor]) -> Any:
    *tensors, marker = received
    kind = _KINDS[marker.shape[1]]
    if kind == "tensor":
        return tensors[0]
    return list(tensors) if kind == "list" else tuple(tensors)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        inner = ", ".join(type(v).__name__ for v in value[:4])
        return f"a {type(value).__name__} of [{inner}{', ...' if len(value) > 4 else ''}]"
    return f"a {type(value).__name__}"


class ManualStage(PipelineStageModule):
    """A :class:`PipelineStageModule` as the runtime calls it: ``forward(*received, *inputs)``.

    The first stage's input is the microbatch's list of ``inputs``; later stages unpack what
    they receive. Non-last stages return packed tensors; the last returns the loss:
    ``loss_fn(out[0], labels[0])`` (``out`` itself if it is a tensor), or, without a loss
    function, the loss ``output_loss_value_spec`` selects from ``out``.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        stage_of: Sequence[int],
        stage_index: int,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        loss_spec: LossSpec,
    ) -> None:
        num_stages = max(stage_of) + 1
        super().__init__(layers, num_stages, stage_index, stage_of=stage_of)
        self.last = stage_index == num_stages - 1
        self.loss_fn = loss_fn
        self.loss_spec = loss_spec
        self.input_names = (["inputs"] if stage_index == 0 else []) + (
            ["labels"] if self.last and loss_fn is not None else []
        )

    def forward(self, *args: Any) -> Any:
        split = len(args) - len(self.input_names)
        received, inputs = args[:split], dict(zip(self.input_names, args[split:]))
        x = inputs["inputs"] if self.stage_index == 0 else _unpack(received)
        out = super().forward(x)
        if not self.last:
            return _pack(out, self.stage_index)
        if self.loss_fn is None:
            return select_loss(out, self.loss_spec)
        labels = inputs["labels"]
        if labels is None:
            raise ValueError("manual_pp_loss_fn is set: run_train/run_eval need labels=...")
        prediction = out if isinstance(out, torch.Tensor) else out[0]
        return self.loss_fn(prediction, labels[0])


def build_manual_stages(
    layers: Sequence[nn.Module],
    stage_of: Sequence[int],
    local: Sequence[int],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    loss_spec: LossSpec,
) -> dict[int, ManualStage]:
    """The local stages (holding the layer modules themselves)."""
    return {s: ManualStage(layers, stage_of, s, loss_fn, loss_spec) for s in local}


def materialize_manual(
    layers: Sequence[nn.Module],
    stage_of: Sequence[int],
    local: Sequence[int],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> bool:
    """Layers built on ``meta`` get only their local parameters materialised on ``device`` and
    initialised by ``param_init_fn`` (as in traced mode), in place: the stages see them."""
    root = nn.ModuleList(layers)  # qualified names "3.weight", as in the stages
    params: list[dict[str, nn.Parameter]] = []
    buffers: list[dict[str, torch.Tensor]] = []
    for s in local:
        mine = [i for i, stage in enumerate(stage_of) if stage == s]
        params.append({n: t for i in mine for n, t in layers[i].named_parameters(prefix=str(i))})
        buffers.append({n: t for i in mine for n, t in layers[i].named_buffers(prefix=str(i))})
    return materialize_local_parameters(root, params, device, param_init_fn, buffers)
