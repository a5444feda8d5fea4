"""The sub-configs of NxD's training config, one validated dataclass per dict.

NxD scripts pass plain dicts (``optimizer_config={"zero_one_enabled": True, ...}``); each
section here is the typed form of one of them: its fields are the dict's keys with NxD's
defaults, every field is checked on creation, and :meth:`from_nxd` turns the dict (or ``None``,
or an instance) into the section, refusing unknown keys with the closest valid one suggested.
``optimizer_config`` and ``mixed_precision_config`` are nxd-optim's
:class:`~nxd_optim.OptimizerConfig` and :class:`~nxd_optim.MixedPrecisionConfig` (the same
classes, re-exported here). Cross-section rules (ZeRO-1 vs the pipeline's flag, meta init vs
``param_init_fn`` ...) live in :class:`nxd_trainer.NxDConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import TYPE_CHECKING, Any

from nxd_optim import MixedPrecisionConfig, OptimizerConfig
from nxd_optim.checks import (
    as_bool,
    check_choice,
    check_positive_int,
    parse_section,
    reject_unknown_keys,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nxd_pipeline import PipelineOptions

__all__ = ["MixedPrecisionConfig", "ModelInitConfig", "OptimizerConfig", "PipelineConfig"]

# NxD's documented range for sequential_move_factor.
MAX_SEQUENTIAL_MOVE_FACTOR = 32


def as_dict(section: Any) -> dict[str, Any]:
    """The section as NxD's dict (shallow: classes and functions are kept as they are); a
    pipeline section's XLA runtime knobs become top-level keys, as NxD's scripts write them."""
    out = {f.name: getattr(section, f.name) for f in fields(section)}
    out.update(out.pop("xla_runtime_options", None) or {})
    return out


@dataclass(kw_only=True)
class ModelInitConfig:
    """NxD's ``model_init_config``: where and how the model's parameters come to exist."""

    sequential_move_factor: int = 11
    """How many processes of a node materialise and move their model at the same time (the
    others wait), bounding peak host memory: 1 to 32."""

    meta_device_init: bool = False
    """Build the model on the ``meta`` device (no memory), then materialise only this rank's
    shard with ``param_init_fn``."""

    param_init_fn: Callable[..., Any] | None = None
    """Initialises one module's own (already allocated) parameters and meta buffers, in place:
    ``param_init_fn(module)`` as in NxD, or ``param_init_fn(module, device)``. Required with
    ``meta_device_init``."""

    def __post_init__(self) -> None:
        section = "model_init_config"
        check_positive_int(
            section, "sequential_move_factor", self.sequential_move_factor,
            upper=MAX_SEQUENTIAL_MOVE_FACTOR,
        )  # fmt: skip
        self.meta_device_init = as_bool(section, "meta_device_init", self.meta_device_init)
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(
                f"model_init_config['param_init_fn'] must be callable, got {self.param_init_fn!r}"
            )

    @classmethod
    def from_nxd(cls, value: Any) -> ModelInitConfig:
        return parse_section(cls, "model_init_config", value)


def _check_classes(section: str, name: str, value: Any) -> None:
    """None, or a list/tuple of classes or class names."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(item, (type, str)) for item in value
    ):
        raise TypeError(
            f"{section}[{name!r}] must be a list of classes or class names, got {value!r}"
        )


@dataclass(kw_only=True)
class PipelineConfig:
    """NxD's ``pipeline_config``: the arguments of :class:`nxd_pipeline.NxDPPModel`, plus the
    model/optimizer-wrapper flags NxD's trainer reads."""

    transformer_layer_cls: type | str | None = None
    """The transformer layer class (or its name): a leaf of the traced graph, the unit of
    ``auto_partition`` and of ``"full"`` activation checkpointing. Hugging Face models: found
    from ``_no_split_modules`` when omitted."""

    num_microbatches: int = 1
    """Micro-batches per ``run_train`` step; the batch dimension must divide by it."""

    output_loss_value_spec: dict[str, bool] | tuple[bool, ...] | bool | None = None
    """Which output is the loss, NxD's form: ``True`` (the output is the loss tensor),
    ``(True, False)``, ``{"loss": True}``, nested; ``None`` (nxd): the output itself, its
    ``"loss"`` entry or its first element."""

    return_mb_loss: bool = False
    """``run_train`` returns the list of micro-batch losses instead of their mean."""

    broadcast_and_average_loss: bool = False
    """``run_train`` returns the loss on every rank, averaged over data parallelism too."""

    pipeline_cuts: list[str] | None = None
    """Names of the layers after which a stage ends: ``pipeline_parallel_size ×
    virtual_pipeline_size − 1`` of them (or ``auto_partition``)."""

    input_names: list[str] | None = None
    """The model inputs ``run_train`` takes (traced as graph inputs). Required for Hugging
    Face models; plain modules default to ``forward``'s parameters."""

    leaf_module_cls: list[type | str] | None = None
    """Module classes (or class names) kept whole in the traced graph."""

    autowrap_functions: tuple[Callable[..., Any], ...] | list[Any] | None = None
    """Functions the FX tracer records as calls instead of tracing through."""

    autowrap_modules: tuple[ModuleType, ...] | list[Any] | None = None
    """Python modules whose functions the FX tracer records as calls."""

    tracer_cls: str | type | None = None
    """``"torch"`` (default, torch.fx), ``"hf"`` (torch.export, Hugging Face models) or an
    ``fx.Tracer`` subclass."""

    param_init_fn: Callable[..., Any] | None = None
    """Initialiser of meta parameters (see ``model_init_config``; the two must agree)."""

    trace_file_path: str | None = None
    """Write the traced graph to this file."""

    use_zero1_optimizer: bool | None = None
    """Whether ZeRO-1 reduces the gradients (default and required: ``optimizer_config``'s
    ``zero_one_enabled``)."""

    use_model_wrapper: bool | None = None
    """NxD's flag: always true under ``initialize_parallel_model`` (False is an error)."""

    use_optimizer_wrapper: bool | None = None
    """Who averages gradients over data parallelism: True, the optimizer wrapper; False, the
    pipeline after each step (then ``initialize_parallel_optimizer`` refuses the config);
    None, the optimizer wrapper if one is built over the model's parameters, else the model."""

    auto_partition: bool = False
    """Choose the cuts (after transformer layers) that balance the stages' compute."""

    virtual_pipeline_size: int = 1
    """Model chunks per rank (> 1: the interleaved 1F1B schedule)."""

    schedule: str | None = None
    """nxd: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved_1f1b"`` or ``"zb_h1"``."""

    async_sends: bool | None = None
    """nxd: non-blocking point-to-point transfers (default: on for gloo)."""

    return_loss_on_cpu: bool = True
    """Move the returned loss to the CPU (NxD's default; free on CPU)."""

    deallocate_pipeline_outputs: bool = False
    """NxD's XLA memory option; nxd frees sent activations anyway (accepted, logged)."""

    fuse_microbatches: bool = False
    """NxD's XLA option (one graph for all micro-batches): accepted and passed to
    ``NxDPPModel``, where it has no effect on the computation (as there, it turns
    ``return_loss_on_cpu`` off)."""

    autowrap_obj_methods: dict[Any, list[str]] | None = None
    """Objects whose named methods the FX tracer records as calls (``{obj: ["method"]}``)."""

    xla_runtime_options: dict[str, Any] = field(default_factory=dict)
    """NxD's private XLA runtime knobs given as ``pipeline_config`` keys
    (``_all_reduce_send_recv``, ``_use_gloo_for_metadata_comm`` ...): accepted, passed to
    ``NxDPPModel``, no effect. In NxD's dict they are top-level keys (see :func:`as_dict`)."""

    def __post_init__(self) -> None:
        from nxd_pipeline import SCHEDULE_NAMES

        section = "pipeline_config"
        check_positive_int(section, "num_microbatches", self.num_microbatches)
        check_positive_int(section, "virtual_pipeline_size", self.virtual_pipeline_size)
        for name in (
            "return_mb_loss",
            "broadcast_and_average_loss",
            "auto_partition",
            "return_loss_on_cpu",
            "deallocate_pipeline_outputs",
            "fuse_microbatches",
        ):
            setattr(self, name, as_bool(section, name, getattr(self, name)))
        for name in ("use_zero1_optimizer", "use_model_wrapper", "use_optimizer_wrapper"):
            if getattr(self, name) is not None:
                setattr(self, name, as_bool(section, name, getattr(self, name)))
        _check_runtime_options(self.xla_runtime_options)
        if self.fuse_microbatches and self.return_loss_on_cpu:  # NxDPPModel's rule
            self.return_loss_on_cpu = False
        if self.use_model_wrapper is False:
            raise ValueError(
                "pipeline_config['use_model_wrapper'] is False, but initialize_parallel_model "
                "always wraps the model: leave it out or set it True"
            )
        if self.return_mb_loss and self.broadcast_and_average_loss:
            raise ValueError(
                "pipeline_config: 'return_mb_loss' and 'broadcast_and_average_loss' are "
                "exclusive (broadcast_and_average_loss needs return_mb_loss=False)"
            )
        if self.auto_partition and self.pipeline_cuts:
            raise ValueError(
                f"pipeline_config: 'auto_partition' chooses the cuts itself; got "
                f"'pipeline_cuts'={self.pipeline_cuts}"
            )
        for name in ("pipeline_cuts", "input_names"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value)
            ):
                raise TypeError(f"pipeline_config[{name!r}] must be a list of str, got {value!r}")
        _check_classes(section, "leaf_module_cls", self.leaf_module_cls)
        if self.transformer_layer_cls is not None and not isinstance(
            self.transformer_layer_cls, (type, str)
        ):
            raise TypeError(
                f"pipeline_config['transformer_layer_cls'] must be a class or a class name, "
                f"got {self.transformer_layer_cls!r}"
            )
        if self.schedule is not None:
            check_choice(section, "schedule", self.schedule, SCHEDULE_NAMES)
        if isinstance(self.tracer_cls, str):
            check_choice(section, "tracer_cls", self.tracer_cls, ("torch", "hf"))
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(
                f"pipeline_config['param_init_fn'] must be callable, got {self.param_init_fn!r}"
            )

    @property
    def num_cuts(self) -> int:
        return len(self.pipeline_cuts or ())

    def options(
        self,
        *,
        transformer_layer_cls: type | None,
        leaf_module_cls: Sequence[type],
        input_names: Sequence[str] | None,
        tracer_cls: str | type | None,
        param_init_fn: Callable[[nn.Module], None] | None,
        use_zero1_optimizer: bool,
        device: torch.device,
    ) -> PipelineOptions:
        """This section as :class:`nxd_pipeline.PipelineOptions`, NxDPPModel's options.

        The section's keys map onto the fields of the same names (its XLA runtime knobs onto
        ``xla_runtime_options``). The keywords are what needs the model or the rest of NxD's
        config, resolved by ``initialize_parallel_model``: the layer and leaf classes (names
        looked up in the model), the captured inputs (context parallelism adds its own), the
        tracer (``"hf"`` for a Hugging Face model), the meta initialiser
        (``model_init_config``'s or this section's), whether an optimizer rather than the
        pipeline averages gradients over DP, and this rank's device. ``use_model_wrapper``,
        ``use_optimizer_wrapper`` and ``return_loss_on_cpu`` keep NxDPPModel's defaults
        (:class:`~nxd_trainer.NxDModel` acts on them); ``deallocate_pipeline_outputs`` has no
        effect and is not passed.
        """
        from nxd_pipeline import PipelineOptions

        return PipelineOptions(
            transformer_layer_cls=transformer_layer_cls,
            num_microbatches=self.num_microbatches,
            output_loss_value_spec=self.output_loss_value_spec,
            return_mb_loss=self.return_mb_loss,
            broadcast_and_average_loss=self.broadcast_and_average_loss,
            pipeline_cuts=list(self.pipeline_cuts) if self.pipeline_cuts else None,
            input_names=list(input_names) if input_names is not None else None,
            leaf_module_cls=list(leaf_module_cls),
            autowrap_functions=tuple(self.autowrap_functions or ()),
            autowrap_modules=tuple(self.autowrap_modules or ()),
            tracer_cls=tracer_cls,
            param_init_fn=param_init_fn,
            trace_file_path=self.trace_file_path,
            use_zero1_optimizer=use_zero1_optimizer,
            auto_partition=self.auto_partition,
            virtual_pipeline_size=self.virtual_pipeline_size,
            schedule=self.schedule,
            device=device,
            async_sends=self.async_sends,
            fuse_microbatches=self.fuse_microbatches,
            autowrap_obj_methods=self.autowrap_obj_methods,
            xla_runtime_options=dict(self.xla_runtime_options),
        )

    @classmethod
    def from_nxd(cls, value: Any) -> PipelineConfig | None:
        if isinstance(value, Mapping):  # NxD's runtime knobs are top-level keys of the dict
            from nxd_pipeline import XLA_RUNTIME_OPTIONS

            knobs = {k: v for k, v in value.items() if k in XLA_RUNTIME_OPTIONS}
            if knobs:
                rest = {k: v for k, v in value.items() if k not in XLA_RUNTIME_OPTIONS}
                value = {
                    **rest,
                    "xla_runtime_options": {**rest.get("xla_runtime_options", {}), **knobs},
                }
        return None if value is None else parse_section(cls, "pipeline_config", value)


def _check_runtime_options(options: Any) -> None:
    from nxd_pipeline import XLA_RUNTIME_OPTIONS

    if not isinstance(options, dict):
        raise TypeError(f"pipeline_config['xla_runtime_options'] must be a dict, got {options!r}")
    reject_unknown_keys("pipeline_config XLA runtime option", options, sorted(XLA_RUNTIME_OPTIONS))
