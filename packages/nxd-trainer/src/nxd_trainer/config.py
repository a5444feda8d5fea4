"""NxD's training config: ``neuronx_distributed_config(...)`` and the dataclass behind it.

A config is one global description of the job, the same on every rank:
``world = TP x PP x DP`` ranks, the pipeline and optimizer sections, activation checkpointing,
LoRA, mixed precision and how the model is initialised. ``neuronx_distributed_config`` returns
NxD's dict (scripts index it: ``nxd_config["optimizer_config"]["zero_one_enabled"]``); every
entry point re-reads that dict through :meth:`NxDConfig.from_nxd`, so a bad key or a
contradiction fails on every rank, before any collective, naming the key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

import nxd_state
from nxd_optim.checks import (
    as_bool,
    check_bool,
    check_positive_int,
    closest,
    reject_unknown_keys,
)
from nxd_trainer.sections import (
    MixedPrecisionConfig,
    ModelInitConfig,
    OptimizerConfig,
    PipelineConfig,
    as_dict,
)

__all__ = ["NxDConfig", "neuronx_distributed_config"]

logger = logging.getLogger(__name__)

# The keys of NxD's config dict, in NxD's order.
NXD_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "expert_parallel_size",
    "context_parallel_size",
    "context_parallel_algorithm",
    "pipeline_config",
    "optimizer_config",
    "activation_checkpoint_config",
    "pad_model",
    "sequence_parallel",
    "model_init_config",
    "lora_config",
    "mixed_precision_config",
    "lnc_size",
    "parallelize_hf_models",
)


def _check_activation_checkpoint(value: Any) -> None:
    """None, "full", a module class, or a non-empty list/tuple of module classes."""
    if value is None or value == "full":
        return
    if isinstance(value, str):
        hint = closest(value, ["full"])
        raise ValueError(
            f"activation_checkpoint_config must be 'full', None or torch.nn.Module classes, got "
            f"{value!r}" + (f" (did you mean {hint!r}?)" if hint else "")
        )
    classes = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if not classes or bad:
        raise TypeError(
            f"activation_checkpoint_config must be 'full', None or torch.nn.Module classes "
            f"(classes, not instances), got {value!r}"
        )


@dataclass(kw_only=True)
class NxDConfig:
    """The typed, validated form of NxD's config dict."""

    tensor_parallel_size: int = 1
    """TP: ranks sharding each layer's weights (consecutive ranks)."""

    pipeline_parallel_size: int = 1
    """PP: ranks holding consecutive slices of the layer stack; > 1 needs ``pipeline_config``."""

    expert_parallel_size: int = 1
    """Newer NxD's expert parallelism (EP): the experts of every MoE layer split over EP
    consecutive data-parallel ranks (EP divides DP; expert DP = DP / EP). A Hugging Face
    Mixtral, Qwen2-MoE or Qwen3-MoE model is parallelised by :mod:`nxd_trainer.hf` (experts
    sharded over EP, TP inside each expert); a model built from ``nxd_layers.moe`` shards its
    experts itself. The optimizer averages expert gradients over the expert-DP group (with
    ZeRO-1, ``NeuronEPZero1Optimizer`` shards expert state over it); checkpoints hold every
    expert and reshard across EP degrees. At PP > 1 each stage holds its layers' experts,
    sharded over EP (the router's auxiliary loss, ``output_router_logits=True``, is refused
    there: it sums over every stage's layers). EP > 1 needs CP = 1 and no LoRA."""

    context_parallel_size: int = 1
    """Newer NxD's context parallelism: every sequence split over ``context_parallel_size``
    ranks (the ``[PP, DP, CP, TP]`` layout), for a Hugging Face causal LM of a registered
    family (Llama, Mistral, Qwen2, Qwen3): ``NxDModel`` splits its inputs, positions and labels,
    its attention runs over the whole sequence, its loss is the whole sequence's mean, and the
    optimizer wrapper averages gradients over DP x CP (LoRA adapters too). At PP > 1 the
    stages pass this rank's slice of the activations and each micro-batch's loss is its whole
    sequence's mean (``pipeline_config["input_names"]`` must hold ``labels``)."""

    context_parallel_algorithm: str = "ring"
    """nxd: the context-parallel attention, ``"ring"`` (K/V blocks passed around the ring,
    zigzag split: the sequence length must divide by ``2 x context_parallel_size``) or
    ``"all_to_all"`` (sequence <-> heads: heads per TP rank must divide by
    ``context_parallel_size``, and the sequence length by it)."""

    pipeline_config: PipelineConfig | None = None
    """:class:`~nxd_trainer.PipelineConfig` (NxDPPModel's arguments); used when PP > 1 (and its
    ``transformer_layer_cls`` by ``"full"`` activation checkpointing at any PP)."""

    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    """:class:`~nxd_optim.OptimizerConfig` (also ``nxd_trainer.OptimizerConfig``): ZeRO-1,
    clipping."""

    activation_checkpoint_config: Any = None
    """``"full"`` (recompute every transformer layer), module classes (recompute those), or
    None (off)."""

    pad_model: bool | str = False
    """Pad attention heads up to a multiple of TP (PP = 1 only; the model needs
    ``config.num_attention_heads``). ``True``: NxD's layout (each rank zero-pads its own
    shard, so a head split across ranks is changed, as in NxD); ``"head_aligned"`` (nxd): the
    full weights get whole zero heads at the end and are re-sharded, so the padded model
    computes what the original did."""

    sequence_parallel: bool = False
    """Sequence parallelism: the model's TP layers run with ``sequence_parallel_enabled`` and
    the optimizer sums the gradients of sequence-parallel replicated weights over TP."""

    model_init_config: ModelInitConfig = field(default_factory=ModelInitConfig)
    """:class:`~nxd_trainer.ModelInitConfig`: meta-device init, ``param_init_fn``, waves."""

    lora_config: Any = None
    """An ``nxd_lora.LoraConfig``: LoRA is applied whenever one is given, as in NxD (its
    ``enable_lora`` is not consulted)."""

    mixed_precision_config: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """:class:`~nxd_optim.MixedPrecisionConfig` (also ``nxd_trainer.MixedPrecisionConfig``),
    resolved against ZeRO-1 on creation."""

    lnc_size: int = 1
    """NxD's logical NeuronCores per rank (trn2): a positive int, passed to
    ``nxd_state.initialize_model_parallel``, where it has no effect (nxd's group order is always
    row-major ``[PP, DP, TP]``; it matters only to Neuron's runtime on Trainium)."""

    parallelize_hf_models: bool = True
    """nxd: at ``tensor_parallel_size > 1``, a Hugging Face model of a supported family that
    ``model_fn`` returns unparallelised is parallelised by :mod:`nxd_trainer.hf` (TP, SP with
    ``sequence_parallel``, the pipeline's leaves). False: the model is used as returned."""

    def __post_init__(self) -> None:
        # Sections given as NxD's dicts (or None) become their dataclasses.
        self.pipeline_config = PipelineConfig.from_nxd(self.pipeline_config)
        self.optimizer_config = OptimizerConfig.from_nxd(self.optimizer_config)
        self.model_init_config = ModelInitConfig.from_nxd(self.model_init_config)
        self.mixed_precision_config = MixedPrecisionConfig.from_nxd(self.mixed_precision_config)
        check_positive_int("config", "tensor_parallel_size", self.tensor_parallel_size)
        check_positive_int("config", "pipeline_parallel_size", self.pipeline_parallel_size)
        check_positive_int("config", "expert_parallel_size", self.expert_parallel_size)
        check_positive_int("config", "context_parallel_size", self.context_parallel_size)
        from nxd_trainer._context_parallel import ALGORITHMS

        if self.context_parallel_algorithm not in ALGORITHMS:
            hint = closest(str(self.context_parallel_algorithm), list(ALGORITHMS))
            raise ValueError(
                f"context_parallel_algorithm must be one of {ALGORITHMS}, got "
                f"{self.context_parallel_algorithm!r}"
                + (f" (did you mean {hint!r}?)" if hint else "")
            )
        check_positive_int("config", "lnc_size", self.lnc_size)
        if not (isinstance(self.pad_model, bool) or self.pad_model == "head_aligned"):
            raise ValueError(
                f"pad_model must be True, False or 'head_aligned', got {self.pad_model!r}"
            )
        self.sequence_parallel = as_bool("config", "sequence_parallel", self.sequence_parallel)
        check_bool("config", "parallelize_hf_models", self.parallelize_hf_models)
        _check_activation_checkpoint(self.activation_checkpoint_config)
        if self.lora_config is not None:
            from nxd_lora import LoraConfig

            if not isinstance(self.lora_config, LoraConfig):
                raise TypeError(
                    f"lora_config must be an nxd_lora.LoraConfig (NxD's "
                    f"neuronx_distributed.modules.lora.LoraConfig), got "
                    f"{type(self.lora_config).__name__}"
                )
        zero1 = self.optimizer_config.zero_one_enabled
        self.mixed_precision_config = self.mixed_precision_config.resolved(zero1)
        self._check_cross_section_rules()

    def _check_cross_section_rules(self) -> None:
        """The rules between sections, in this order: what each feature needs of the degrees,
        expert parallelism, the meta initialiser, then the pipeline."""
        self._check_feature_degrees()
        self._check_expert_parallel()
        self._check_param_init()
        self._check_pipeline()

    def _check_feature_degrees(self) -> None:
        """Sequence parallelism needs TP > 1; LoRA and ``pad_model`` run at PP = 1."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.sequence_parallel and tp == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_parallel_size > 1 (the sequence is split "
                "over the tensor-parallel ranks), got tensor_parallel_size=1"
            )
        if self.lora_enabled and pp > 1:
            raise ValueError(
                f"lora_config with pipeline_parallel_size={pp} is not supported yet: LoRA runs "
                f"at pipeline_parallel_size=1 (any TP and DP)"
            )
        if self.pad_model and pp > 1:
            raise ValueError(
                f"pad_model=True is supported with pipeline_parallel_size=1 only (as in NxD), "
                f"got pipeline_parallel_size={pp}"
            )

    def _check_param_init(self) -> None:
        """One ``param_init_fn`` (the two sections' agree), and one at all with meta init."""
        init = self.model_init_config
        pipe = self.pipeline_config
        if (
            pipe is not None
            and pipe.param_init_fn is not None
            and init.param_init_fn is not None
            and pipe.param_init_fn is not init.param_init_fn
        ):
            raise ValueError(
                "pipeline_config['param_init_fn'] and model_init_config['param_init_fn'] are "
                "different functions: set one of them (or the same one in both)"
            )
        if init.meta_device_init and self.param_init_fn is None:
            raise ValueError(
                "model_init_config['meta_device_init'] is True but no 'param_init_fn' is given: "
                "a model built on the meta device has no values until param_init_fn(module) "
                "initialises each module's parameters"
            )

    def _check_pipeline(self) -> None:
        """``pipeline_config`` agrees with ZeRO-1; at PP > 1 it exists, cuts the model into
        PP x virtual_pipeline_size stages, and fits context parallelism."""
        pipe, pp = self.pipeline_config, self.pipeline_parallel_size
        if pipe is not None:
            zero1 = self.optimizer_config.zero_one_enabled
            if pipe.use_zero1_optimizer is not None and pipe.use_zero1_optimizer != zero1:
                raise ValueError(
                    f"pipeline_config['use_zero1_optimizer']={pipe.use_zero1_optimizer} "
                    f"contradicts optimizer_config['zero_one_enabled']={zero1}: set them equal "
                    f"(or leave use_zero1_optimizer out)"
                )
        if pp == 1:
            return
        cp = self.context_parallel_size
        if cp > 1 and pipe is not None:
            from nxd_trainer._context_parallel import pipeline_input_names

            pipeline_input_names(pipe.input_names)  # the loss needs the labels
        if pipe is None:
            raise ValueError(
                f"pipeline_parallel_size={pp} needs pipeline_config (at least 'pipeline_cuts' "
                f"or 'auto_partition', and 'input_names' for Hugging Face models)"
            )
        self._check_stages(pipe)

    def _check_stages(self, pipe: PipelineConfig) -> None:
        """PP x virtual_pipeline_size stages: that many cuts minus one, or ``auto_partition``
        (which cuts after transformer layers)."""
        pp = self.pipeline_parallel_size
        stages = pp * pipe.virtual_pipeline_size
        if not pipe.pipeline_cuts and not pipe.auto_partition:
            raise ValueError(
                f"pipeline_parallel_size={pp} x virtual_pipeline_size="
                f"{pipe.virtual_pipeline_size} = {stages} stages need pipeline_config"
                f"['pipeline_cuts'] ({stages - 1} layer names) or 'auto_partition': True"
            )
        if pipe.pipeline_cuts and pipe.num_cuts != stages - 1:
            raise ValueError(
                f"pipeline_config['pipeline_cuts'] has {pipe.num_cuts} cuts "
                f"{list(pipe.pipeline_cuts)}, but pipeline_parallel_size={pp} x "
                f"virtual_pipeline_size={pipe.virtual_pipeline_size} = {stages} stages need "
                f"{stages - 1}"
            )
        if pipe.auto_partition and pipe.transformer_layer_cls is None and pipe.tracer_cls != "hf":
            raise ValueError(
                "pipeline_config['auto_partition'] cuts after transformer layers: give "
                "'transformer_layer_cls'"
            )

    def _check_expert_parallel(self) -> None:
        """EP > 1 runs at CP = 1, without LoRA, at any TP, PP and DP (ZeRO-1 is nxd-optim's
        EP-aware ``NeuronEPZero1Optimizer``)."""
        ep = self.expert_parallel_size
        if ep == 1:
            return
        cp = self.context_parallel_size
        if cp > 1:
            raise ValueError(
                f"expert_parallel_size={ep} with context_parallel_size={cp} is not supported "
                f"yet: expert parallelism runs with context_parallel_size=1 (any TP, PP and DP)"
            )
        if self.lora_enabled:
            raise ValueError(
                f"lora_config with expert_parallel_size={ep} is not supported yet: LoRA runs "
                f"at expert_parallel_size=1"
            )

    # Derived settings ---------------------------------------------------------------------
    @property
    def param_init_fn(self) -> Any:
        """The initialiser of meta parameters (model_init_config's, else pipeline_config's)."""
        if self.model_init_config.param_init_fn is not None:
            return self.model_init_config.param_init_fn
        return self.pipeline_config.param_init_fn if self.pipeline_config else None

    @property
    def lora_enabled(self) -> bool:
        """Whether LoRA is applied: a ``LoraConfig`` is given (as in NxD)."""
        return self.lora_config is not None

    def check_world(self, world_size: int) -> nxd_state.ParallelLayout:
        """The ``[PP, DP, CP, TP]`` layout on ``world_size`` ranks (the degrees must fit)."""
        return nxd_state.ParallelLayout(
            world_size=world_size,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_parallel_size,
        )

    # NxD's dict ---------------------------------------------------------------------------
    def to_nxd(self) -> dict[str, Any]:
        """NxD's config dict (what ``neuronx_distributed_config`` returns)."""
        out: dict[str, Any] = {}
        for name in NXD_KEYS:
            value = getattr(self, name)
            if isinstance(
                value, (PipelineConfig, OptimizerConfig, ModelInitConfig, MixedPrecisionConfig)
            ):
                value = as_dict(value)
            out[name] = value
        return out

    @classmethod
    def from_nxd(cls, config: Mapping[str, Any] | NxDConfig) -> NxDConfig:
        """Parse and validate NxD's dict (or return an NxDConfig as is)."""
        if isinstance(config, NxDConfig):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(
                f"nxd_config must be the dict returned by neuronx_distributed_config, got "
                f"{type(config).__name__}"
            )
        reject_unknown_keys("nxd_config", config, [f.name for f in fields(cls)])
        return cls(**dict(config))


def _with_move_factor(model_init_config: Any, sequential_move_factor: int) -> Any:
    """``model_init_config`` with NxD's top-level ``sequential_move_factor`` filled in.

    As in NxD the section's own value wins and the keyword fills it when the section lacks it;
    a keyword other than the default 11 that differs from the section's value is an error.
    """
    check_positive_int(
        "neuronx_distributed_config", "sequential_move_factor", sequential_move_factor
    )
    if model_init_config is None:
        return {"sequential_move_factor": sequential_move_factor}
    if isinstance(model_init_config, ModelInitConfig):
        own: Any = model_init_config.sequential_move_factor
    elif isinstance(model_init_config, Mapping):
        if "sequential_move_factor" not in model_init_config:
            return {**model_init_config, "sequential_move_factor": sequential_move_factor}
        own = model_init_config["sequential_move_factor"]
    else:
        return model_init_config  # ModelInitConfig.from_nxd names the bad type
    if sequential_move_factor != _DEFAULT_MOVE_FACTOR and own != sequential_move_factor:
        raise ValueError(
            f"sequential_move_factor={sequential_move_factor!r} contradicts "
            f"model_init_config['sequential_move_factor']={own!r}: set one of them (or the "
            f"same value in both)"
        )
    return model_init_config


_DEFAULT_MOVE_FACTOR = 11


def neuronx_distributed_config(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pipeline_config: dict[str, Any] | None = None,
    optimizer_config: dict[str, Any] | None = None,
    activation_checkpoint_config: Any = None,
    pad_model: bool | str = False,
    sequence_parallel: bool = False,
    model_init_config: dict[str, Any] | None = None,
    lora_config: Any = None,
    mixed_precision_config: dict[str, Any] | None = None,
    *,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    context_parallel_algorithm: str = "ring",
    sequential_move_factor: int = _DEFAULT_MOVE_FACTOR,
    lnc_size: int = 1,
    parallelize_hf_models: bool = True,
    **unknown: Any,
) -> dict[str, Any]:
    """NxD's config: validate every setting, initialise model parallelism, return NxD's dict.

    ``world = tensor_parallel_size x pipeline_parallel_size x DP``. Defaults are NxD's:
    ``optimizer_config`` = ``{"zero_one_enabled": False, "grad_clipping": True,
    "max_grad_norm": 1.0}``, ``model_init_config`` = ``{"sequential_move_factor": 11,
    "meta_device_init": False, "param_init_fn": None}``, master weights and fp32 gradient
    accumulation on exactly with ZeRO-1.

    Process groups: built now with a process group or under a launcher (torchrun); with
    neither, later by ``initialize_parallel_model``, as in NxD.

    NxD's newer keywords ``context_parallel_size``, ``lnc_size`` and ``sequential_move_factor``
    (fills ``model_init_config['sequential_move_factor']`` when the section lacks it; a
    different non-default value in both is an error), and nxd's ``context_parallel_algorithm``,
    ``expert_parallel_size`` and ``parallelize_hf_models``: see :class:`NxDConfig`'s fields.
    """
    if unknown:
        reject_unknown_keys("neuronx_distributed_config argument", unknown, NXD_KEYS, TypeError)
    config = NxDConfig.from_nxd(  # NxD's dict, parsed (into sections) as every NxD dict is
        dict(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size,
            context_parallel_algorithm=context_parallel_algorithm,
            pipeline_config=pipeline_config,
            optimizer_config=optimizer_config,
            activation_checkpoint_config=activation_checkpoint_config,
            pad_model=pad_model,
            sequence_parallel=sequence_parallel,
            model_init_config=_with_move_factor(model_init_config, sequential_move_factor),
            lora_config=lora_config,
            mixed_precision_config=mixed_precision_config,
            lnc_size=lnc_size,
            parallelize_hf_models=parallelize_hf_models,
        )
    )
    _initialize_if_launched(config)
    logger.info("NxD config: %s", config)
    return config.to_nxd()


def _initialize_if_launched(config: NxDConfig) -> None:
    """NxD's moment to build the TP/PP/DP groups: now with a process group (the degrees must
    fit the world), or under a launcher that gives each process its rank (torchrun: ``RANK``
    and ``WORLD_SIZE`` set; the group is created from ``env://`` first). With neither (a plain
    ``python`` run, or a Lightning script before its ``Trainer`` starts the processes) nothing
    is created, as in NxD: ``initialize_parallel_model`` (or the Lightning strategy) builds the
    groups later."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torch.distributed.is_initialized() or launched:
        initialize_model_parallel(config)
    else:
        logger.info(
            "no process group and no launcher (RANK/WORLD_SIZE unset): the parallel groups "
            "are built by initialize_parallel_model"
        )


def initialize_model_parallel(config: NxDConfig) -> nxd_state.ParallelState:
    """Create the process group if needed, check the degrees fit it, build the TP/PP/DP groups.

    The fit is checked before any group is built, so a bad degree fails on every rank alike.
    """
    if not torch.distributed.is_initialized():
        nxd_state.init_distributed()
    config.check_world(torch.distributed.get_world_size())
    return nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel_size,
        pipeline_model_parallel_size=config.pipeline_parallel_size,
        lnc_size=config.lnc_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_parallel_size,
    )
