"""NxDPPModel's options: one frozen dataclass checked on creation, and NxD's keyword form.

``PipelineOptions`` holds every argument of :class:`nxd_pipeline.NxDPPModel` except the module.
Its first 25 fields are NxD's parameters in the order of NxD's source, so
:meth:`PipelineOptions.from_nxd` binds a positional NxD call exactly as NxD does; NxD's
``_debug_*`` keywords map onto the ``debug_*`` fields and NxD's XLA runtime knobs
(:data:`XLA_RUNTIME_OPTIONS`) onto ``xla_runtime_options``. Every check that does not need the
module runs in ``__post_init__``, on every rank, before any collective; each error is one line
naming the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn

from nxd_pipeline._loss import LossSpec, check_loss_spec
from nxd_pipeline._schedules import canonical_schedule_name

__all__ = ["NXD_KEYWORDS", "XLA_RUNTIME_OPTIONS", "PartitionFn", "PipelineOptions"]

logger = logging.getLogger(__name__)

PartitionFn = Callable[[Sequence[nn.Module], int], dict[nn.Module, int]]
"""NxD's ``manual_pp_stage_partition_fn(layers, num_stages) -> {layer: stage}``."""

XLA_RUNTIME_OPTIONS = frozenset(
    {
        "_delay_tracing",
        "_turn_off_odd_even_scheduler",
        "_all_reduce_send_recv",
        "_fused_send_recv",
        "_fused_fwd_bwd",
        "_mark_step_before_pp_runtime",
        "_mark_step_after_pp_runtime",
        "_deallocate_send_tensors",
        "_use_gloo_for_metadata_comm",
    }
)
"""NxD's knobs for its XLA runtime (graph breaks, fused send/recv graphs, how metadata travels,
freeing sent outputs): accepted so NxD calls work unchanged; this runtime has no use for them."""

NXD_KEYWORDS = {
    "_debug_mode": "debug_mode",
    "_debug_pp_size": "debug_pp_size",
    "_debug_pp_rank": "debug_pp_rank",
}
"""NxD's keyword -> the field it sets, where the names differ (NxD's private ``_debug_*``)."""

_NXD_POSITIONAL = 25
"""NxD's parameters after ``module`` that a positional call reaches: the first 25 fields."""


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """Everything :class:`~nxd_pipeline.NxDPPModel` takes besides the module, with NxD's
    defaults: ``NxDPPModel(module, options=PipelineOptions(num_microbatches=4, ...))`` equals
    ``NxDPPModel(module, num_microbatches=4, ...)``. Checked on creation (see the module)."""

    # NxD's parameters, in the order of NxD's source (positional calls bind in this order).
    transformer_layer_cls: type | str | None = None
    """The transformer layer class (or, beyond NxD, its class name): a leaf of the captured
    graph and the unit of ``auto_partition``. ``tracer_cls="hf"``: found from the model's
    ``_no_split_modules`` when None."""
    num_microbatches: int = 1
    """m: each ``run_train`` / ``run_eval`` batch is split into m microbatches along dim 0;
    the loss is the mean of their m losses."""
    virtual_pipeline_size: int = 1
    """v: model chunks per rank. The model is cut into p·v stages; stage s runs on pipeline
    rank s mod p (interleaving when v > 1)."""
    output_loss_value_spec: LossSpec = None
    """Which output is the loss: ``True`` (the output is the loss tensor), ``(True, False)``,
    ``{"loss": True, "logits": False}``, nested; None (beyond NxD): a tensor output, a
    ``loss`` key/attribute or the first element. A spec marking nothing True is an error."""
    return_mb_loss: bool = False
    """Return the list of m microbatch losses instead of their mean."""
    broadcast_and_average_loss: bool = False
    """Return the mean loss on every rank, averaged over DP x CP too (exclusive with
    ``return_mb_loss``)."""
    use_zero1_optimizer: bool = False
    """ZeRO-1 averages gradients over data parallelism at its step: ``run_train`` does not."""
    use_model_wrapper: bool = False
    """A model wrapper materialises and moves the local parameters by calling
    ``move_model_to_device()``; else construction does."""
    use_optimizer_wrapper: bool = False
    """An optimizer wrapper averages gradients over data parallelism at its step:
    ``run_train`` does not."""
    pipeline_cuts: list[str] | None = None
    """p·v - 1 layer names; stage k ends after cut k. None with ``auto_partition`` or p·v = 1."""
    input_names: list[str] | None = None
    """The model inputs ``run_train`` takes, traced as graph inputs (default: ``forward``'s
    parameters; required for ``tracer_cls="hf"``)."""
    leaf_module_cls: list[type | str] | None = None
    """Module classes (or class names) kept whole in the captured graph; a name matching no
    module is ignored with a warning, as NxD does."""
    autowrap_functions: tuple[Callable[..., Any], ...] | None = None
    """Functions the FX tracer records as calls instead of tracing through."""
    autowrap_modules: tuple[ModuleType, ...] | None = None
    """Python modules whose functions the FX tracer records as calls."""
    autowrap_obj_methods: Mapping[Any, Sequence[str]] | None = None
    """``{object: [method names]}``: each method recorded as one call of the bound method and
    run eagerly by its stage (FX route)."""
    tracer_cls: str | type[fx.Tracer] | None = None
    """``"torch"`` (default, torch.fx), ``"hf"`` (torch.export, Hugging Face models) or an
    ``fx.Tracer`` subclass."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """Initialises one module's own meta parameters (not its submodules'): run on this rank's
    stages only, by ``move_model_to_device()``."""
    trace_file_path: str | None = None
    """Write the captured graph to this file."""
    return_loss_on_cpu: bool | None = True
    """Return the mean loss on the CPU (the ``return_mb_loss`` list stays on the device).
    Turned off, with a warning, by ``fuse_microbatches`` (NxD's rule): see
    :attr:`loss_on_cpu`."""
    deallocate_pipeline_outputs: bool = False
    """NxD's: free sent activations. No effect (sent outputs are not held)."""
    auto_partition: bool | None = False
    """Choose the p·v - 1 cuts among the ``transformer_layer_cls`` layers (no
    ``pipeline_cuts``)."""
    fuse_microbatches: bool | None = False
    """NxD's: one graph for all microbatches. Here they still run one by one; the loss comes
    back on the device, as in NxD."""
    manual_pp_partition: bool | None = False
    """The module is a list of layers, split into stages without any capture."""
    manual_pp_stage_partition_fn: PartitionFn | None = None
    """Manual mode: ``fn(layers, p·v) -> {layer: stage}`` (default: n // (p·v) layers per
    stage, the remainder on the last)."""
    manual_pp_loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    """Manual mode: the last stage's loss ``fn(out[0], labels[0])``."""

    # Keyword-only in NxDPPModel's signature.
    debug_mode: bool = False
    """NxD's ``_debug_mode``: partition as pipeline rank ``debug_pp_rank`` of
    ``debug_pp_size`` without process groups (stages to inspect; no step can run)."""
    debug_pp_size: int = 8
    """NxD's ``_debug_pp_size``: p under ``debug_mode``."""
    debug_pp_rank: int = 0
    """NxD's ``_debug_pp_rank``: this rank, in [0, ``debug_pp_size``), under ``debug_mode``."""
    schedule: str | None = None
    """``"1f1b"`` (default when v = 1), ``"gpipe"``, ``"interleaved_1f1b"`` (default when
    v > 1) or ``"zb_h1"``; see :data:`nxd_pipeline.SCHEDULE_NAMES`."""
    device: torch.device | str | None = None
    """Where the local stages live (default: where the model's parameters are; CPU for a
    meta model)."""
    async_sends: bool | None = None
    """Non-blocking p2p (sends left in flight, receives waited for where their data is used)
    instead of synchronous batches. None: on for gloo only (unbatched crossing sends can
    deadlock a stream-ordered backend)."""
    xla_runtime_options: Mapping[str, Any] = field(default_factory=dict)
    """NxD's XLA runtime knobs (names in :data:`XLA_RUNTIME_OPTIONS`): accepted, no effect."""

    def __post_init__(self) -> None:
        self._check_xla_runtime_options()
        self._check_sizes()
        self._check_debug()
        self._check_loss()
        self._check_partition()
        self._check_types()
        if self.schedule is not None:
            canonical_schedule_name(self.schedule, self.virtual_pipeline_size)

    def _check_xla_runtime_options(self) -> None:
        unknown = sorted(set(self.xla_runtime_options) - XLA_RUNTIME_OPTIONS)
        if unknown:
            raise TypeError(
                f"xla_runtime_options has unknown keys {unknown}: expected names from "
                f"{sorted(XLA_RUNTIME_OPTIONS)}"
            )
        if self.xla_runtime_options:
            logger.debug(
                "NxD XLA runtime options without effect here: %s", self.xla_runtime_options
            )

    def _check_sizes(self) -> None:
        for name in ("num_microbatches", "virtual_pipeline_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def _check_debug(self) -> None:
        size, rank = self.debug_pp_size, self.debug_pp_rank
        if self.debug_mode and not (
            isinstance(size, int) and isinstance(rank, int) and 0 <= rank < size
        ):
            raise ValueError(
                f"_debug_mode=True needs _debug_pp_size >= 1 and 0 <= _debug_pp_rank < "
                f"_debug_pp_size, got _debug_pp_size={size!r}, _debug_pp_rank={rank!r}"
            )

    def _check_loss(self) -> None:
        if self.return_mb_loss and self.broadcast_and_average_loss:
            raise ValueError(
                "return_mb_loss=True and broadcast_and_average_loss=True are exclusive: "
                "broadcast_and_average_loss requires return_mb_loss=False"
            )
        check_loss_spec(self.output_loss_value_spec)

    def _check_partition(self) -> None:
        if self.auto_partition and self.pipeline_cuts:
            raise ValueError(
                f"auto_partition=True chooses the cuts itself; got "
                f"pipeline_cuts={self.pipeline_cuts}"
            )
        manual_options = (self.manual_pp_loss_fn, self.manual_pp_stage_partition_fn)
        if self.manual_pp_partition and (self.pipeline_cuts or self.auto_partition):
            raise ValueError(
                f"manual_pp_partition=True splits the layer list itself, got pipeline_cuts="
                f"{self.pipeline_cuts!r}, auto_partition={self.auto_partition!r}: drop "
                f"pipeline_cuts and auto_partition (use manual_pp_stage_partition_fn to choose "
                f"the stages)"
            )
        if not self.manual_pp_partition and any(o is not None for o in manual_options):
            logger.warning("manual_pp_* arguments are ignored without manual_pp_partition=True")

    def _check_types(self) -> None:
        """Values that would otherwise fail late, deep in the capture or the first step (or,
        for a string where a list of names belongs, be read one character at a time)."""
        for name in ("pipeline_cuts", "input_names"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, str)
                or not isinstance(value, (list, tuple))
                or not all(isinstance(item, str) for item in value)
            ):
                raise TypeError(f"{name} must be a list of names (str), got {value!r}")
        layer = self.transformer_layer_cls
        if layer is not None and not isinstance(layer, (type, str)):
            raise TypeError(f"transformer_layer_cls must be a class or a class name, got {layer!r}")
        tracer = self.tracer_cls
        if tracer not in (None, "torch", "hf") and not (
            isinstance(tracer, type) and issubclass(tracer, fx.Tracer)
        ):
            raise ValueError(
                f"tracer_cls must be 'torch', 'hf', None or a torch.fx.Tracer subclass, got "
                f"{tracer!r}"
            )
        for name in ("param_init_fn", "manual_pp_stage_partition_fn", "manual_pp_loss_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable or None, got {value!r}")
        if self.async_sends not in (None, True, False):
            raise TypeError(f"async_sends must be True, False or None, got {self.async_sends!r}")
        if self.device is not None and not isinstance(self.device, torch.device):
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(
                    f"device must be a torch.device or a device string such as 'cpu', got "
                    f"{self.device!r}"
                ) from error

    def check_module(self, module: nn.Module | Sequence[nn.Module]) -> None:
        """The check that needs the module: a layer list exactly with ``manual_pp_partition``."""
        if bool(self.manual_pp_partition) != isinstance(module, (list, tuple)):
            raise TypeError(
                "manual_pp_partition=True takes the model as a list of layers"
                if self.manual_pp_partition
                else f"a {type(module).__name__} of layers needs manual_pp_partition=True"
            )

    @property
    def loss_on_cpu(self) -> bool:
        """``return_loss_on_cpu``, unless ``fuse_microbatches`` (NxD's rule: then False)."""
        return bool(self.return_loss_on_cpu) and not self.fuse_microbatches

    @property
    def schedule_name(self) -> str:
        """The schedule to build: ``schedule``, else interleaved 1F1B when v > 1, else 1F1B."""
        if self.schedule is not None:
            return self.schedule
        return "interleaved_1f1b" if self.virtual_pipeline_size > 1 else "1f1b"

    @classmethod
    def from_nxd(cls, *args: Any, **kwargs: Any) -> PipelineOptions:
        """The options of an NxD call ``NxDPPModel(module, *args, **kwargs)`` (without the
        module): positional arguments in NxD's order, NxD's ``_debug_*`` keywords, its XLA
        runtime knobs; any other keyword is a TypeError naming it."""
        bound = _NXD_SIGNATURE.bind(*args, **kwargs).arguments
        knobs = bound.pop("xla_runtime_options", {})
        unknown = sorted(set(knobs) - XLA_RUNTIME_OPTIONS)
        if unknown:
            raise TypeError(f"NxDPPModel got unexpected keyword arguments {unknown}")
        fields = {NXD_KEYWORDS.get(name, name): value for name, value in bound.items()}
        return cls(**fields, xla_runtime_options=knobs)


def nxd_signature(
    *, leading: Sequence[str] = (), trailing: Sequence[str] = ()
) -> inspect.Signature:
    """NxD's signature of NxDPPModel, built from the fields: ``leading`` positional names
    (``self``, ``module``), the 25 positional fields, the keyword-only ones under NxD's names,
    ``trailing`` keyword-only names (``options``) and the XLA knobs as ``**xla_runtime_options``."""
    Parameter = inspect.Parameter
    params = [Parameter(name, Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    fields = [f for f in dataclasses.fields(PipelineOptions) if f.name != "xla_runtime_options"]
    nxd_names = {field: nxd for nxd, field in NXD_KEYWORDS.items()}
    for index, f in enumerate(fields):
        kind = (
            Parameter.POSITIONAL_OR_KEYWORD if index < _NXD_POSITIONAL else Parameter.KEYWORD_ONLY
        )
        name = nxd_names.get(f.name, f.name)
        params.append(Parameter(name, kind, default=f.default, annotation=f.type))
    params += [Parameter(name, Parameter.KEYWORD_ONLY, default=None) for name in trailing]
    params.append(Parameter("xla_runtime_options", Parameter.VAR_KEYWORD, annotation="Any"))
    return inspect.Signature(params)


_NXD_SIGNATURE = nxd_signature()
