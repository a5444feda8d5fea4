"""NxD's optimizer wrapper: data-parallel gradient sync, clipping and precision around any
``torch.optim`` optimizer.

One step, with n data-parallel ranks:

    g <- Σ_TP g                    for sequence-parallel params (replicated, partial per shard)
    g <- (1/n) Σ_DP g              bucketed all-reduce (or, with ZeRO-1, reduce-scatter);
                                   expert params at EP > 1: (1/n) Σ over the expert-DP group
    g <- g · min(1, c / ‖g‖)       ‖g‖ over the whole model across TP and PP, c = max_grad_norm
                                   (c = inf: ‖g‖ measured, g left as is)
    θ32 <- inner.step(θ32, g)      fp32 master weights for bf16/fp16 params, then θ <- cast(θ32)

n = DP x CP. With expert parallelism (EP > 1) each rank holds E/EP experts of every MoE layer:
their gradients are summed over the expert-DP group (the n/EP ranks holding the same experts)
and divided by n, and the norm counts each expert once. ZeRO-1 at EP > 1 is
:class:`~nxd_optim.NeuronEPZero1Optimizer` (expert state sharded over expert-DP, the same scale).

Without ZeRO-1 the fp32 masters θ32 of the bf16/fp16 params are views of one flat fp32 buffer
per device, and their gradients views of another, kept between steps
(:mod:`nxd_optim._flat_masters`): a step casts the gradients in with one multi-tensor copy (with
``use_fp32_grad_acc`` the accumulation buffers are those views, so nothing is copied), steps
the masters and rounds them into the params with another; the inner optimizer still sees one
tensor per param. Resident: 4 bytes per bf16/fp16 param (θ32) plus 4 per trainable one (∇θ32).

Gradients of micro-batches accumulate locally (in fp32 with ``use_fp32_grad_acc``); nothing is
communicated before :meth:`NxDOptimizer.step`. :meth:`NxDOptimizer.scale_gradients` (``1/k``)
turns the sum of k micro-batches' gradients into their mean, wherever they are kept.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

import nxd_state
from nxd_layers import clip_grad_norm, get_grad_norm
from nxd_optim._flat_masters import FlatMasters
from nxd_optim._grad_sync import all_reduce_bucketed, is_expert_param, is_sequence_parallel_param
from nxd_optim._groups import check_params_on_backend_device
from nxd_optim._mixed_precision import GradientStore
from nxd_optim._state_io import read_state, write_state
from nxd_optim.config import MixedPrecisionConfig, OptimizerConfig
from nxd_optim.ep_zero1 import NeuronEPZero1Optimizer
from nxd_optim.zero1 import NeuronZero1Optimizer, as_param_groups
from nxd_state import collectives
from nxd_state.shards import (
    FlatCheckpointLayout,
    FlatShardedState,
    MasterWeightsLayout,
    MasterWeightsState,
    RankContext,
)

__all__ = ["NxDOptimizer", "build_optimizer"]

logger = logging.getLogger(__name__)


class NxDOptimizer(Optimizer, FlatShardedState, MasterWeightsState):
    """θ <- step(θ, clip((1/n) Σ_DP g)): NxD's optimizer wrapper around ``optimizer_class``.

    Behaves like ``optimizer_class(params, **defaults)``, plus the parallel work of one step
    (see the module docstring). Its checkpoint state (:mod:`nxd_state.shards`): with ZeRO-1
    the flat layout (:class:`~nxd_state.shards.FlatShardedState`), without it the fp32 masters
    (:class:`~nxd_state.shards.MasterWeightsState`).

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so LR schedulers
    work unchanged. With ``config.zero_one_enabled`` the wrapped optimizer is a
    :class:`NeuronZero1Optimizer` over the data x context parallel group, at EP > 1 a
    :class:`~nxd_optim.NeuronEPZero1Optimizer` (experts over the expert-DP group), as NxD's
    ``initialize_optimizer_from_class`` picks.

    ``config`` is NxD's ``optimizer_config`` and ``mixed_precision`` its
    ``mixed_precision_config``: each an :class:`~nxd_optim.OptimizerConfig` /
    :class:`~nxd_optim.MixedPrecisionConfig`, NxD's dict, or None (the defaults). The mixed
    precision settings are resolved against ZeRO-1 (NxD's defaults: master weights and fp32
    gradient accumulation exactly with ZeRO-1) and kept as ``self.mixed_precision``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        *,
        config: OptimizerConfig | Mapping[str, Any] | None = None,
        mixed_precision: MixedPrecisionConfig | Mapping[str, Any] | None = None,
        **defaults: Any,
    ) -> None:
        # Optimizer.__init__ is not called: the wrapped optimizer owns the groups and state.
        self.config = OptimizerConfig.from_nxd(config)
        self.mixed_precision = MixedPrecisionConfig.from_nxd(mixed_precision).resolved(
            self.config.zero_one_enabled
        )
        mixed = self.mixed_precision
        self.parallel_state = nxd_state.get_parallel_state()
        groups = as_param_groups(params, "NxDOptimizer")
        self._params = [p for group in groups for p in group["params"]]
        check_params_on_backend_device(
            self._params, self.parallel_state.data_parallel_group, "NxDOptimizer"
        )
        self._grad_norm: torch.Tensor | None = None
        self._masters = FlatMasters()
        self._inner: Optimizer
        if self.config.zero_one_enabled:
            # NxD's choice: at EP > 1 the EP-aware ZeRO-1 (experts sharded over expert-DP).
            expert_parallel = self.parallel_state.expert_model_parallel_size > 1
            zero1_class = NeuronEPZero1Optimizer if expert_parallel else NeuronZero1Optimizer
            self._inner = zero1_class(
                groups,
                optimizer_class,
                grad_clipping=self.config.grad_clipping,
                max_norm=self.config.max_grad_norm,
                norm_type=self.config.norm_type,
                # DP x CP: context-parallel ranks hold the same weights and partial gradients.
                sharding_groups=self.parallel_state.data_context_parallel_group,
                grad_norm_groups=self.parallel_state.tensor_parallel_group,
                use_master_weights=mixed.master_weights,
                use_fp32_grad_acc=mixed.fp32_grad_acc,
                use_master_weights_in_ckpt=mixed.use_master_weights_in_ckpt,
                **defaults,
            )
            self._grads: GradientStore | None = None
        else:
            if mixed.master_weights:
                self._masters.add(self._params)
            views = self._masters.gradient_views()  # fp32 accumulation sums into them
            self._grads = GradientStore(
                self._params, fp32_accumulation=mixed.fp32_grad_acc, buffers=views
            )
            self._inner = optimizer_class([self._inner_group(g) for g in groups], **defaults)
        logger.info(
            "NxDOptimizer(%s): zero1=%s clipping=%s max_norm=%s masters=%d fp32_grad_acc=%s",
            optimizer_class.__name__,
            self.config.zero_one_enabled,
            self.config.grad_clipping,
            self.config.max_grad_norm,
            len(self._masters.by_param()),
            mixed.fp32_grad_acc,
        )

    def flat_checkpoint_layout(self, ctx: RankContext) -> FlatCheckpointLayout | None:
        """The wrapped ZeRO-1 optimizer's flat layout, for checkpoints; None without ZeRO-1."""
        inner = self._inner
        return inner.flat_checkpoint_layout(ctx) if isinstance(inner, FlatShardedState) else None

    @property
    def optimizer(self) -> Optimizer:
        """The wrapped optimizer (NeuronZero1Optimizer with ZeRO-1). The methods use it as
        ``self._inner``: Lightning's ``LightningOptimizer`` takes this class as a base and
        defines its own ``optimizer`` property, which would otherwise shadow this one."""
        return self._inner

    @optimizer.setter
    def optimizer(self, value: Optimizer) -> None:
        self._inner = value

    def _inner_group(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The group the wrapped optimizer steps: fp32 masters stand in for bf16/fp16 params."""
        masters = self._masters.by_param()
        return {**group, "params": [masters.get(p, p) for p in group["params"]]}

    # torch.optim.Optimizer surface, delegated --------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.defaults

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm before clipping at the last step; None before the first
        step or when clipping is off. To measure it without clipping, keep ``grad_clipping``
        on with ``max_grad_norm=math.inf`` (the gradients are then left as they are)."""
        return self._grad_norm

    def scale_gradients(self, factor: float) -> None:
        """G <- factor · G for the gradients accumulated for the coming :meth:`step`, in place.

        k micro-batches accumulate G = Σ_i ∇L_i; ``factor = 1/k`` makes G their mean, the
        gradient of the mean loss (the larger batch's, for equal micro-batch sizes). Every
        reduction between backward and step (the sequence-parallel sum over TP, the DP mean,
        ZeRO-1's reduce-scatter, a pipeline's tied-weight sum) is linear, so this equals
        scaling every micro-batch's loss by ``factor``, and works where the loss cannot be
        scaled (a pipeline schedule running the backward). Clipping and :attr:`grad_norm` then
        see the scaled gradient. Call it after the last backward and before :meth:`step`.

        The gradients are scaled where they wait for the step: ``p.grad``; the fp32 buffers of
        ``use_fp32_grad_acc`` (``p.grad`` is None there); ZeRO-1's accumulators. bf16/fp16
        params with fp32 master weights keep their gradient in ``p.grad`` until the step, so it
        is rounded once to bf16/fp16 (exact when ``factor`` is a power of two); the masters get
        it in ``step()``. Frozen params are left alone. Local: no collective, no allocation.
        ``factor`` must be finite; 1.0 does nothing.
        """
        if isinstance(self._inner, NeuronZero1Optimizer):
            self._inner.scale_gradients(factor)
            return
        trainable = [p for p in self._params if p.requires_grad]
        self._store().scale(trainable, factor, "NxDOptimizer.scale_gradients")

    def master_weights_by_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{model param: its fp32 master weight}``: θ32 of every bf16/fp16 param that the
        wrapped optimizer steps in the param's place (``use_master_weights`` without ZeRO-1),
        in the order of the params given (the order of ``state_dict()["master_weights"]``).

        The dict is new on every call; its keys are the model's params and its values the live
        masters, the very tensors in ``param_groups[...]["params"]`` (same shape, float32,
        tensor-parallel attributes copied from the param): views of one flat fp32 buffer per
        device (per construction / ``add_param_group``), whose ``.grad`` is a view of a flat
        gradient buffer that stays attached across ``zero_grad`` (None for frozen params).
        Writing into a master (``copy_``) changes what the next step starts from; the param is
        set to the rounded master only by ``step()``.
        Empty with ZeRO-1 (its fp32 masters are flat shards per dtype bucket:
        ``optimizer.dtype_buckets[i].master``), without ``use_master_weights``, or when no
        param is bf16/fp16.
        """
        return self._masters.by_param()

    def master_checkpoint_layout(self) -> MasterWeightsLayout:
        """The wrapped optimizer and :meth:`master_weights_by_param`, for checkpoints
        (:class:`nxd_state.shards.MasterWeightsState`); the masters are saved with
        ``use_master_weights_in_ckpt``. Without ZeRO-1 only: a ZeRO-1 optimizer's state is
        its flat layout (:meth:`flat_checkpoint_layout`)."""
        masters = self.master_weights_by_param()
        in_checkpoint = bool(masters) and self.mixed_precision.use_master_weights_in_ckpt
        return MasterWeightsLayout(self._inner, masters, in_checkpoint)

    def __repr__(self) -> str:
        return (
            f"NxDOptimizer({self._inner!r}, config={self.config}, "
            f"mixed_precision={self.mixed_precision})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = as_param_groups([param_group], "NxDOptimizer.add_param_group")[0]
        check_params_on_backend_device(
            group["params"], self.parallel_state.data_parallel_group, "NxDOptimizer"
        )
        self._params.extend(group["params"])
        if isinstance(self._inner, NeuronZero1Optimizer):
            self._inner.add_param_group(group)
        else:
            if self.mixed_precision.master_weights:
                self._masters.add(group["params"])
            self._store().add_params(group["params"], self._masters.gradient_views())
            self._inner.add_param_group(self._inner_group(group))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``p.grad`` <- None (zeros with ``set_to_none=False``), fp32 accumulators <- 0. The
        masters' gradient views stay attached and allocated (the next step overwrites them)."""
        if isinstance(self._inner, NeuronZero1Optimizer):
            self._inner.zero_grad(set_to_none=set_to_none)
            return
        self._store().zero(self._params, set_to_none=set_to_none)
        self._masters.release_gradients()

    # The step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.parallel_state
        zero = self._inner if isinstance(self._inner, NeuronZero1Optimizer) else None
        # Frozen params (requires_grad=False) are left alone: no gradient, no update. ZeRO-1
        # refuses them at construction, so both lists below are in the same order.
        params = [p for p in self._params if p.requires_grad]
        grads = zero.gradients() if zero is not None else self._store().grads(params)
        sequence_parallel = [g for p, g in zip(params, grads) if is_sequence_parallel_param(p)]
        all_reduce_bucketed(
            sequence_parallel,
            state.tensor_parallel_group,
            average=False,
            bucket_cap_bytes=self.config.bucket_cap_bytes,
        )
        if zero is not None:
            zero.step()
            self._grad_norm = zero.grad_norm
            return loss
        self._average_over_data_parallel(params, grads)
        stepped = self._masters.gradients(params, grads)  # G <- float32(g): one copy
        if self.config.grad_clipping:
            tp, pp = state.tensor_parallel_group, state.pipeline_parallel_group
            if math.isfinite(self.config.max_grad_norm):
                self._grad_norm = clip_grad_norm(
                    stepped,
                    self.config.max_grad_norm,
                    self.config.norm_type,
                    tensor_parallel_group=tp,
                    pipeline_parallel_group=pp,
                )
            else:  # max_grad_norm = inf: measure only (clipping would multiply g by 1)
                self._grad_norm = get_grad_norm(
                    stepped,
                    self.config.norm_type,
                    tensor_parallel_group=tp,
                    pipeline_parallel_group=pp,
                )
        self._inner.step()
        self._masters.copy_to_params()  # θ <- round(θ32): one multi-tensor copy
        return loss

    def _average_over_data_parallel(
        self, params: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> None:
        """g <- (1/(DP·CP)) Σ g over the ranks holding the same param, in place.

        Non-expert params: averaged over DP x CP (each context-parallel rank's gradient is its
        sequence slice's share of the mean loss's gradient; the DP group itself when CP = 1).
        Expert params (``expert_model_parallel``) at EP > 1: each rank holds E/EP experts and
        its local gradient already sums, through the all-to-all's backward, the tokens of its
        whole EP group; the ranks holding the same experts are the expert-DP group (DP·CP/EP
        ranks) and together they have seen every token once, so the whole batch's mean-loss
        gradient is (1/(DP·CP)) Σ_expert-DP g = (1/EP) · mean_expert-DP g.
        """
        state = self.parallel_state
        cap = self.config.bucket_cap_bytes
        ep = state.expert_model_parallel_size
        experts = [g for p, g in zip(params, grads) if ep > 1 and is_expert_param(p)]
        others = [g for p, g in zip(params, grads) if not (ep > 1 and is_expert_param(p))]
        all_reduce_bucketed(
            others, state.data_context_parallel_group, average=True, bucket_cap_bytes=cap
        )
        if experts:
            all_reduce_bucketed(
                experts, state.expert_data_parallel_group, average=True, bucket_cap_bytes=cap
            )
            torch._foreach_mul_(experts, 1.0 / ep)

    def _store(self) -> GradientStore:
        assert self._grads is not None
        return self._grads

    # State --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (this rank's shard with ZeRO-1); with
        ``use_master_weights_in_ckpt`` also ``master_weights`` (in param order)."""
        out = self._inner.state_dict()
        masters = self._masters.by_param()
        if masters and self.mixed_precision.use_master_weights_in_ckpt:
            out["master_weights"] = [m.detach().clone() for m in masters.values()]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(self._inner, NeuronZero1Optimizer):  # it restores its own masters
            self._inner.load_state_dict(state_dict)
            return
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        self._inner.load_state_dict(state_dict)
        with torch.no_grad():
            if masters is not None:
                for master, saved in zip(self._masters.by_param().values(), masters, strict=True):
                    master.copy_(saved)
            else:  # rebuild the masters from the model's (already loaded) params
                for param, master in self._masters.by_param().items():
                    master.copy_(param)

    def _unsharded_prefix(self, output_dir: Path) -> Path:
        """optim.tpXX.ppYY; at EP > 1 also .epZZ: the ranks of an EP group hold different
        experts, so their states differ."""
        state = self.parallel_state
        name = f"optim.tp{state.tensor_parallel_rank:02d}.pp{state.pipeline_parallel_rank:02d}"
        if state.expert_model_parallel_size > 1:
            name += f".ep{state.expert_model_parallel_rank:02d}"
        return output_dir / name

    def _writes_unsharded(self) -> bool:
        """One writer per distinct state: the first rank of the DP x CP group (all replicas
        alike), at EP > 1 the first of the expert-DP group (the replicas of these experts)."""
        state = self.parallel_state
        if state.expert_model_parallel_size > 1:
            return state.rank == state.expert_data_parallel_ranks[0]
        return state.rank == state.data_context_parallel_ranks[0]

    def save_sharded_state_dict(self, output_dir: str | Path, save_serially: bool = True) -> None:
        """ZeRO-1: every rank writes its shard. Otherwise DP rank 0 of each TP/PP coordinate
        writes the (DP x CP-replicated) state; at EP > 1 the first rank of each expert-DP group
        writes its EP rank's state (its experts' and, replicated, the rest). safetensors + JSON
        either way."""
        if isinstance(self._inner, NeuronZero1Optimizer):
            self._inner.save_sharded_state_dict(output_dir, save_serially=save_serially)
            return
        state = self.parallel_state
        if self._writes_unsharded():
            write_state(self.state_dict(), self._unsharded_prefix(Path(output_dir)), {})
        collectives.barrier(state.data_context_parallel_group)

    def load_sharded_state_dict(
        self, output_dir: str | Path, num_workers_per_step: int = 8
    ) -> None:
        if isinstance(self._inner, NeuronZero1Optimizer):
            self._inner.load_sharded_state_dict(output_dir, num_workers_per_step)
            return
        state, _ = read_state(self._unsharded_prefix(Path(output_dir)))
        self.load_state_dict(state)


def build_optimizer(
    optimizer_config: Mapping[str, Any] | OptimizerConfig | None,
    optimizer_class: type[Optimizer],
    parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    mixed_precision_config: Mapping[str, Any] | MixedPrecisionConfig | None = None,
    **defaults: Any,
) -> NxDOptimizer:
    """An :class:`NxDOptimizer` from NxD's ``optimizer_config`` (keys zero_one_enabled,
    grad_clipping, max_grad_norm; nxd's norm_type, bucket_cap_mb) and
    ``mixed_precision_config`` (use_master_weights, use_fp32_grad_acc,
    use_master_weights_in_ckpt), each a dict, its dataclass or None; ``defaults`` go to
    ``optimizer_class``."""
    return NxDOptimizer(
        parameters,
        optimizer_class,
        config=optimizer_config,
        mixed_precision=mixed_precision_config,
        **defaults,
    )
