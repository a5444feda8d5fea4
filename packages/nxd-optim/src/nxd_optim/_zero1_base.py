"""ZeRO-1's set-up and torch-xla's surface: groups, dtype buckets, master shards, the inner
optimizer (``base_optimizer``), lazy initialisation and state dicts.

:class:`Zero1Setup` holds everything but the step (which is in :mod:`nxd_optim.zero1`). Its
names are torch-xla's ``ZeroRedundancyOptimizer``'s (which NxD's ``NeuronZero1Optimizer``
subclasses), so code written against it finds what it touches: ``base_optimizer``,
``sharding_groups``, ``grad_norm_groups``, ``optimizer_dtype``, ``local_world_size``,
``local_rank``, ``inited``, ``init_zero()``, ``get_shape_info()``, ``remove_hooks()``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from nxd_optim import _zero1_checkpoint
from nxd_optim._base_view import BaseOptimizerView
from nxd_optim._buckets import DtypeBucket, split_by_dtype
from nxd_optim._flat import FlatLayout
from nxd_optim._groups import (
    GroupSpec,
    check_params_on_backend_device,
    current_state_or_none,
    refuse_expert_parallelism,
    resolve_group,
    resolve_sharding_group,
    shard_norm_group,
)
from nxd_optim._mixed_precision import GradientStore, is_low_precision
from nxd_optim._param_views import VIEW_DEVICE_TYPES, ParamViews
from nxd_optim._params import as_param_groups
from nxd_optim._zero1_comm import GRAD_REDUCTIONS, resolve_grad_reduction

__all__ = ["Zero1Setup"]

logger = logging.getLogger(__name__)
_MIB = 2**20


def _check_options(
    *,
    optimizer_class: type[Optimizer],
    grad_clipping: bool,
    max_norm: float | None,
    norm_type: float,
    bucket_cap_mb_all_gather: float,
    bucket_cap_mb_reduce_scatter: float,
    grad_reduction: str,
    optimizer_dtype: torch.dtype | None,
) -> float:
    """One clear error for a bad ZeRO-1 option; returns ``max_norm`` (1.0 when None)."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    max_norm = 1.0 if max_norm is None else float(max_norm)
    if grad_clipping and not max_norm > 0:  # NaN fails too; inf means measure only
        raise ValueError(
            f"max_norm must be positive (math.inf: measure the norm, clip nothing), got {max_norm}"
        )
    if not float(norm_type) > 0:
        raise ValueError(f"norm_type must be positive (or math.inf), got {norm_type}")
    for name, cap in (
        ("bucket_cap_mb_all_gather", bucket_cap_mb_all_gather),
        ("bucket_cap_mb_reduce_scatter", bucket_cap_mb_reduce_scatter),
    ):
        if not cap >= 0:
            raise ValueError(f"{name} must be >= 0 (0: no cap), got {cap}")
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    if optimizer_dtype is not None and not optimizer_dtype.is_floating_point:
        raise ValueError(f"optimizer_dtype must be a floating dtype, got {optimizer_dtype}")
    return max_norm


class Zero1Setup(Optimizer):
    """Everything of :class:`~nxd_optim.NeuronZero1Optimizer` except the step."""

    # True only for the expert half of NeuronEPZero1Optimizer (sharded over expert-DP, its
    # gradients scaled and its norm summed by that optimizer); any other ZeRO-1 refuses
    # expert params at EP > 1.
    _holds_expert_shards = False

    def __init__(
        self,
        params: Any,
        optimizer_class: type[Optimizer],
        *,
        optimizer_dtype: torch.dtype | None,
        grad_clipping: bool,
        max_norm: float | None,
        norm_type: float,
        pin_layout: bool,
        sharding_groups: GroupSpec,
        grad_norm_groups: GroupSpec,
        bucket_cap_mb_all_gather: float,
        bucket_cap_mb_reduce_scatter: float,
        use_master_weights: bool,
        fp32_grad_acc: bool,
        master_weights_in_ckpt: bool,
        higher_cc_precision: bool,
        grad_reduction: str,
        parameters_as_bucket_view: bool,
        defaults: dict[str, Any],
    ) -> None:
        max_norm = _check_options(
            optimizer_class=optimizer_class,
            grad_clipping=grad_clipping,
            max_norm=max_norm,
            norm_type=norm_type,
            bucket_cap_mb_all_gather=bucket_cap_mb_all_gather,
            bucket_cap_mb_reduce_scatter=bucket_cap_mb_reduce_scatter,
            grad_reduction=grad_reduction,
            optimizer_dtype=optimizer_dtype,
        )
        groups = self._param_groups(params)
        self.optimizer_class = optimizer_class
        self._optimizer_dtype = optimizer_dtype
        self.grad_clipping = grad_clipping
        self.max_norm = max_norm
        self.norm_type = float(norm_type)
        self.pin_layout = pin_layout
        self.bucket_cap_mb_all_gather = bucket_cap_mb_all_gather
        self.bucket_cap_mb_reduce_scatter = bucket_cap_mb_reduce_scatter
        self.coalesce_cc_all_gather = bucket_cap_mb_all_gather > 0
        self.coalesce_cc_reduce_scatter = bucket_cap_mb_reduce_scatter > 0
        self.use_master_weights = use_master_weights
        self.use_fp32_grad_acc = self.use_grad_acc_hook = fp32_grad_acc
        self.use_master_weights_in_ckpt = self.save_master_weights = master_weights_in_ckpt
        self.higher_cc_precision = higher_cc_precision
        self.grad_reduction = grad_reduction
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._sharding_spec = sharding_groups
        self._grad_norm_spec = grad_norm_groups
        self._inner_defaults = dict(defaults)
        self._buckets: list[DtypeBucket] = []
        self._grads: GradientStore | None = None
        self._inner: Optimizer | None = None
        self._base_view: BaseOptimizerView | None = None
        self._grad_norm: torch.Tensor | None = None
        self.inited = False
        super().__init__(groups, defaults)

    def _param_groups(self, params: Any) -> list[dict[str, Any]]:
        """The caller's param groups, checked; expert params refused at EP > 1 unless this is
        the expert half of :class:`~nxd_optim.NeuronEPZero1Optimizer`."""
        groups = as_param_groups(params, "NeuronZero1Optimizer")
        if not self._holds_expert_shards:
            refuse_expert_parallelism(
                type(self).__name__, [p for group in groups for p in group["params"]]
            )
        return groups

    # Lazy initialisation ----------------------------------------------------------------
    def init_zero(self) -> None:
        """Resolve the groups, shard the params into master shards, build ``base_optimizer``
        (collective over the sharding group when groups must be created). Called by the
        constructor unless ``lazy_init=True``; calling it again re-shards from the params."""
        if self._grads is not None:
            self._grads.remove_hooks()
        self.sharding_group, self.sharding_ranks = resolve_sharding_group(self._sharding_spec)
        self.sharding_size = len(self.sharding_ranks)
        self.sharding_rank = self.sharding_ranks.index(dist.get_rank())
        self._reduction = resolve_grad_reduction(self.grad_reduction, self.sharding_group)
        state = current_state_or_none()
        self.grad_norm_group: ProcessGroup | None = None
        self._norm_reduce_group: ProcessGroup | None = None
        self._pipeline_group: ProcessGroup | None = None
        if self.grad_clipping:
            self.grad_norm_group = resolve_group(
                self._grad_norm_spec,
                state.tensor_parallel_group if state else None,
                "grad_norm_groups",
            )
            if state is not None and state.pipeline_parallel_size > 1:
                self._pipeline_group = state.pipeline_parallel_group
            if self._reduction == "reduce_scatter":
                self._norm_reduce_group = (
                    shard_norm_group(self.sharding_ranks) or self.sharding_group
                )
        self._buckets = []
        for index in range(len(self.param_groups)):
            self._buckets.extend(self._build_buckets(index))
        self._grads = GradientStore(
            self._all_params(),
            fp32_accumulation=self.use_fp32_grad_acc,
            dtype=self._optimizer_dtype or torch.float32,
        )
        self._inner = self.optimizer_class(
            [self._inner_group(i) for i in range(len(self.param_groups))], **self._inner_defaults
        )
        self._adopt_inner_defaults()
        self.inited = True
        logger.info(
            "ZeRO-1 %s: %d param groups in %d dtype buckets, %d elements sharded over %d ranks "
            "(%d per rank), gradients by %s",
            self.optimizer_class.__name__,
            len(self.param_groups),
            len(self._buckets),
            sum(b.layout.total_numel for b in self._buckets),
            self.sharding_size,
            sum(b.layout.shard_numel for b in self._buckets),
            self._reduction.replace("_", "-"),
        )

    def _check_inited(self, what: str) -> None:
        if not self.inited:
            raise RuntimeError(
                f"NeuronZero1Optimizer.{what}: the optimizer was built with lazy_init=True and "
                f"has not sharded its params yet; call init_zero() first"
            )

    # torch-xla's attributes -------------------------------------------------------------
    @property
    def base_optimizer(self) -> Optimizer:
        """The inner optimizer, stepping one master shard per dtype bucket, seen through
        :class:`~nxd_optim._base_view.BaseOptimizerView`: its ``param_groups`` list one piece
        of the master shard per parameter, as NxD's tests zip them with ours."""
        if self._inner is None:
            raise AttributeError(
                "base_optimizer does not exist before init_zero() (lazy_init=True)"
            )
        if self._base_view is None or self._base_view._inner is not self._inner:
            self._base_view = BaseOptimizerView(self, self._inner)
        return self._base_view  # type: ignore[return-value]

    @property
    def inner_optimizer(self) -> Optimizer:
        return self.base_optimizer

    def _inner_optimizer(self) -> Optimizer:
        """The inner optimizer itself (flat master shards in its ``param_groups``)."""
        self.base_optimizer  # noqa: B018 - the clear error before init_zero()
        assert self._inner is not None
        return self._inner

    @property
    def dtype_buckets(self) -> tuple[DtypeBucket, ...]:
        """The flat buckets (group, positions in the group, dtype, layout, master shard), in
        the order of ``base_optimizer``'s params: what a checkpointer needs of the shards."""
        self._check_inited("dtype_buckets")
        return tuple(self._buckets)

    @property
    def sharding_groups(self) -> Any:
        """The sharding groups as given, or NxD's ``as_list`` form of the default (DP x CP)."""
        if self._sharding_spec is None:
            state = current_state_or_none()
            return state.layout.data_context_parallel_groups() if state else None
        return self._sharding_spec

    @sharding_groups.setter
    def sharding_groups(self, spec: GroupSpec) -> None:
        if self.inited:
            raise RuntimeError(
                "sharding_groups can only change before init_zero() (build with lazy_init=True)"
            )
        self._sharding_spec = spec

    @property
    def grad_norm_groups(self) -> Any:
        """The gradient-norm groups as given, or NxD's ``as_list`` form of the default (TP)."""
        if self._grad_norm_spec is None:
            state = current_state_or_none()
            return state.layout.tensor_parallel_groups() if state else None
        return self._grad_norm_spec

    @property
    def optimizer_dtype(self) -> torch.dtype | None:
        """Dtype of the master shards and optimizer state: the one given, else the one every
        param is promoted to (None if they differ, e.g. bf16 + fp32 without master weights)."""
        if self._optimizer_dtype is not None:
            return self._optimizer_dtype
        dtypes = {self._master_dtype(p.dtype) for p in self._all_params()}
        return dtypes.pop() if len(dtypes) == 1 else None

    @property
    def local_world_size(self) -> int:
        """Ranks in this rank's sharding group (torch-xla's name)."""
        self._check_inited("local_world_size")
        return self.sharding_size

    @property
    def local_rank(self) -> int:
        """This rank's position in its sharding group (torch-xla's name)."""
        self._check_inited("local_rank")
        return self.sharding_rank

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def global_world_size(self) -> int:
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:
        return self._all_params()[0].device

    def get_shape_info(self) -> dict[int, torch.Size]:
        """``{i: shape}`` of every param, numbered across groups in order (torch-xla's)."""
        return {i: p.shape for i, p in enumerate(self._all_params())}

    def remove_hooks(self) -> None:
        """Remove the gradient-accumulation hooks (``use_grad_acc_hook``)."""
        if self._grads is not None:
            self._grads.remove_hooks()

    # Buckets ----------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its params get their own dtype buckets and master shards."""
        super().add_param_group(param_group)
        if not self.inited:
            return
        index = len(self.param_groups) - 1
        self._buckets.extend(self._build_buckets(index))
        self._inner_optimizer().add_param_group(self._inner_group(index))
        self._store_add(self.param_groups[index]["params"])
        self._adopt_inner_defaults()

    def _store_add(self, params: list[torch.Tensor]) -> None:
        assert self._grads is not None
        self._grads.add_params(params)

    def _master_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self._optimizer_dtype is not None:
            return self._optimizer_dtype
        return torch.float32 if self.use_master_weights and is_low_precision(dtype) else dtype

    def _build_buckets(self, index: int) -> list[DtypeBucket]:
        params: list[torch.Tensor] = self.param_groups[index]["params"]
        where = f"NeuronZero1Optimizer param group {index}"
        if not params:
            raise ValueError(f"{where} has no parameters")
        device = check_params_on_backend_device(params, self.sharding_group, where)
        for position, param in enumerate(params):
            if not param.requires_grad:
                raise ValueError(
                    f"{where}: param {position} (shape {tuple(param.shape)}) does not require "
                    f"grad; ZeRO-1 updates every param it holds, so pass trainable params only"
                )
            if not param.is_floating_point():
                raise ValueError(
                    f"{where}: param {position} (shape {tuple(param.shape)}) has dtype "
                    f"{param.dtype}; ZeRO-1 shards floating-point params only"
                )
        buckets = []
        bind = self.parameters_as_bucket_view and device.type in VIEW_DEVICE_TYPES
        for dtype, positions in split_by_dtype(params):
            members = [params[i] for i in positions]
            layout = FlatLayout.for_tensors(members, self.sharding_size)
            views = ParamViews.bind(members, layout) if bind else None
            with torch.no_grad():
                if views is not None:  # F holds the params already, in their dtype
                    own = layout.shard(views.flat, self.sharding_rank)
                    master = own.to(self._master_dtype(dtype), copy=True)
                else:
                    flat = layout.flatten(
                        [p.detach() for p in members], self._master_dtype(dtype), device
                    )
                    master = layout.shard(flat, self.sharding_rank).clone()
            buckets.append(DtypeBucket(index, positions, dtype, layout, master, views))
        return buckets

    def _bucket_params(self, bucket: DtypeBucket) -> list[torch.Tensor]:
        return bucket.params(self.param_groups[bucket.group_index]["params"])

    def _inner_group(self, index: int) -> dict[str, Any]:
        hyper = {k: v for k, v in self.param_groups[index].items() if k != "params"}
        masters = [b.master for b in self._buckets if b.group_index == index]
        return {**hyper, "params": masters}

    def _adopt_inner_defaults(self) -> None:
        """Expose the inner optimizer's hyper-parameters (lr, betas …) on our param groups."""
        for group, inner in zip(self.param_groups, self._inner_optimizer().param_groups):
            for key, value in inner.items():
                if key != "params":
                    group.setdefault(key, value)
        for key, value in self._inner_optimizer().defaults.items():
            self.defaults.setdefault(key, value)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def _reduce_cap_numel(self) -> int:
        return self._cap_numel(self.bucket_cap_mb_reduce_scatter)

    @property
    def _gather_cap_numel(self) -> int:
        return self._cap_numel(self.bucket_cap_mb_all_gather)

    def _cap_numel(self, cap_mb: float) -> int:
        if cap_mb <= 0:
            return 0
        itemsize = max(p.element_size() for p in self._all_params())
        return max(1, int(cap_mb * _MIB) // itemsize)

    def allgather_weights_and_update_full_parameter(self) -> None:
        """params <- the gathered masters; the subclass that steps implements it (loading a
        checkpoint calls it after the masters are set)."""
        raise NotImplementedError(f"{type(self).__name__} does not gather its weights")

    def refresh_masters_from_params(self) -> None:
        """M_r <- shard r of flat(params): after the model's weights were loaded or changed."""
        self._check_inited("refresh_masters_from_params")
        with torch.no_grad():
            for bucket in self._buckets:
                params = [p.detach() for p in self._bucket_params(bucket)]
                flat = bucket.layout.flatten(params, bucket.master.dtype, bucket.master.device)
                bucket.master.copy_(bucket.layout.shard(flat, self.sharding_rank))

    # State dicts and checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The local shard's state: ``state`` (the inner optimizer's, one entry per bucket),
        ``param_groups``, ``shard`` metadata, torch-xla's ``shape_info``, and
        ``master_weights`` when they are saved."""
        self._check_inited("state_dict")
        return _zero1_checkpoint.local_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned on the same sharding rank and layout, or this
        rank's torch-xla / NxD ZeRO-1 state dict (``base_state``, ``shape_info``; then every
        rank of the sharding group must call it: the per-param shards are gathered)."""
        self._check_inited("load_state_dict")
        _zero1_checkpoint.load_local_state_dict(self, state_dict)

    def full_state_dict(self) -> dict[str, Any]:
        """The unsharded state, as a plain optimizer over the model's params would hold it
        (collective: every rank of the sharding group must call it)."""
        self._check_inited("full_state_dict")
        return _zero1_checkpoint.full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's shard of an unsharded state dict (any sharding size saved it)."""
        self._check_inited("load_full_state_dict")
        _zero1_checkpoint.load_full_state_dict(self, state_dict)

    def save_sharded_state_dict(self, output_dir: str | Path, save_serially: bool = True) -> None:
        """Every rank writes its shard to ``output_dir`` (safetensors + JSON)."""
        self._check_inited("save_sharded_state_dict")
        _zero1_checkpoint.save_sharded(self, Path(output_dir), save_serially=save_serially)

    def load_sharded_state_dict(
        self, output_dir: str | Path, num_workers_per_step: int = 8
    ) -> None:
        """Every rank reads its shard from ``output_dir``, ``num_workers_per_step`` at a time."""
        self._check_inited("load_sharded_state_dict")
        _zero1_checkpoint.load_sharded(self, Path(output_dir), num_workers_per_step)
