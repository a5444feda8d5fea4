"""ZeRO-1 on every backend: optimizer state sharded over the data-parallel group.

For each param group, with n ranks in the sharding group and F the flat padded layout of the
group's parameters (see :class:`FlatLayout`), one step on rank r is

    G_r = (1/n) · reduce_scatter(flat(grads))_r        the averaged gradient of shard r
    G_r <- G_r · min(1, max_norm / ‖G‖)                 ‖G‖ over all shards, TP and PP
    M_r <- inner_optimizer.step(M_r, G_r)               M_r: master shard (optimizer dtype)
    params <- unflatten(all_gather(cast(M_r)))          every rank gets every updated shard

so each rank keeps 1/n of the optimizer state (and of the fp32 master weights), and moves
≈ 2Ψ bytes per step for Ψ bytes of parameters. Any ``torch.optim.Optimizer`` class works as
the inner optimizer: it only ever sees one flat tensor per param group.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from nxd_layers import clip_grad_norm, copy_tensor_model_parallel_attributes
from nxd_optim import _zero1_checkpoint
from nxd_optim._flat import FlatLayout
from nxd_optim._groups import (
    GroupSpec,
    check_params_on_backend_device,
    current_state_or_none,
    resolve_group,
    resolve_sharding_group,
    shard_norm_group,
)
from nxd_optim._mixed_precision import GradientStore, is_low_precision
from nxd_state import collectives

__all__ = ["NeuronZero1Optimizer", "as_param_groups"]

logger = logging.getLogger(__name__)


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


class NeuronZero1Optimizer(Optimizer):
    """M_r <- step(M_r, (1/n)·reduce_scatter(g)_r), θ <- all_gather(M_r): NxD's ZeRO-1.

    Wraps ``optimizer_class`` (any ``torch.optim`` optimizer) on any backend; NxD's
    ``NeuronZero1Optimizer`` name and arguments. It does not sum sequence-parallel gradients
    over TP (:class:`~nxd_optim.NxDOptimizer` does, before calling it).

    ``sharding_groups`` / ``grad_norm_groups`` take a ``ProcessGroup`` or NxD's ``as_list``
    form; by default the current parallel state's data-parallel and tensor-parallel groups.
    Clipping (``grad_clipping``, ``max_norm``; ``max_norm=None`` means 1.0 as in torch-xla)
    uses ``nxd_layers.clip_grad_norm`` over the local shard pieces. ``optimizer_dtype`` is the
    dtype of the master shard and the optimizer state: by default float32 for bf16/fp16
    params when ``use_master_weights`` (fp32 master weights), else the params' dtype.
    ``use_fp32_grad_acc`` accumulates micro-batch gradients in fp32 buffers;
    ``use_master_weights_in_ckpt`` puts the master shard in (sharded) state dicts, else it is
    rebuilt from the model's params on load. ``pin_layout`` is accepted for NxD compatibility
    and has no effect (collectives go through ``nxd_state.collectives``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        *,
        optimizer_dtype: torch.dtype | None = None,
        grad_clipping: bool = True,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        pin_layout: bool = True,
        sharding_groups: GroupSpec = None,
        grad_norm_groups: GroupSpec = None,
        use_master_weights: bool = True,
        use_fp32_grad_acc: bool = False,
        use_master_weights_in_ckpt: bool = False,
        **defaults: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
            )
        groups = as_param_groups(params, "NeuronZero1Optimizer")
        max_norm = 1.0 if max_norm is None else float(max_norm)
        if grad_clipping and max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        self.optimizer_class = optimizer_class
        self.optimizer_dtype = optimizer_dtype
        self.grad_clipping = grad_clipping
        self.max_norm = max_norm
        self.norm_type = float(norm_type)
        self.pin_layout = pin_layout
        self.use_master_weights = use_master_weights
        self.use_fp32_grad_acc = use_fp32_grad_acc
        self.use_master_weights_in_ckpt = use_master_weights_in_ckpt
        self.sharding_group, self.sharding_ranks = resolve_sharding_group(sharding_groups)
        self.sharding_size = len(self.sharding_ranks)
        self.sharding_rank = self.sharding_ranks.index(dist.get_rank())
        state = current_state_or_none()
        self.grad_norm_group: ProcessGroup | None = None
        self._norm_reduce_group: ProcessGroup | None = None
        if grad_clipping:
            self.grad_norm_group = resolve_group(
                grad_norm_groups, state.tensor_parallel_group if state else None, "grad_norm_groups"
            )
            self._norm_reduce_group = shard_norm_group(self.sharding_ranks) or self.sharding_group
        self._layouts: list[FlatLayout] = []
        self._masters: list[torch.Tensor] = []
        self._inner: Optimizer | None = None
        self._grad_norm: torch.Tensor | None = None
        super().__init__(groups, defaults)
        self._grads = GradientStore(self._all_params(), fp32_accumulation=use_fp32_grad_acc)
        self._inner = optimizer_class(
            [self._inner_group(i) for i in range(len(self.param_groups))], **defaults
        )
        self._adopt_inner_defaults()
        logger.info(
            "ZeRO-1 %s: %d param groups, %d elements sharded over %d ranks (%d per rank)",
            optimizer_class.__name__,
            len(self._layouts),
            sum(layout.total_numel for layout in self._layouts),
            self.sharding_size,
            sum(layout.shard_numel for layout in self._layouts),
        )

    # Construction --------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its params get their own flat layout and master shard."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        self._build_shard(index)
        if self._inner is not None:
            self._inner.add_param_group(self._inner_group(index))
            self._grads.add_params(self.param_groups[index]["params"])
            self._adopt_inner_defaults()

    def _build_shard(self, index: int) -> None:
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
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1 or not params[0].is_floating_point():
            raise ValueError(
                f"{where} holds params of dtypes {dtypes}: each group is flattened into one "
                f"buffer, so it needs a single floating-point dtype (split the group by dtype)"
            )
        master_dtype = self.optimizer_dtype or (
            torch.float32
            if self.use_master_weights and is_low_precision(params[0].dtype)
            else params[0].dtype
        )
        layout = FlatLayout.for_tensors(params, self.sharding_size)
        with torch.no_grad():
            flat = layout.flatten([p.detach() for p in params], master_dtype, device)
            master = layout.shard(flat, self.sharding_rank).clone()
        self._layouts.append(layout)
        self._masters.append(master)

    def _inner_group(self, index: int) -> dict[str, Any]:
        hyper = {k: v for k, v in self.param_groups[index].items() if k != "params"}
        return {**hyper, "params": [self._masters[index]]}

    def _adopt_inner_defaults(self) -> None:
        """Expose the inner optimizer's hyper-parameters (lr, betas …) on our param groups."""
        assert self._inner is not None
        for group, inner in zip(self.param_groups, self._inner.param_groups):
            for key, value in inner.items():
                if key != "params":
                    group.setdefault(key, value)
        for key, value in self._inner.defaults.items():
            self.defaults.setdefault(key, value)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # The step ------------------------------------------------------------------------
    @property
    def inner_optimizer(self) -> Optimizer:
        assert self._inner is not None
        return self._inner

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """‖G‖ before clipping at the last step; None before the first or without clipping."""
        return self._grad_norm

    def gradients(self) -> list[torch.Tensor]:
        """Every param's local gradient (p.grad or its fp32 accumulator), in place-editable."""
        return self._grads.grads(self._all_params())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._reduce_scatter_gradients()
        if self.grad_clipping:
            self._grad_norm = self._clip_shard_gradients()
        self.inner_optimizer.step()
        self._all_gather_params()
        return loss

    def _sync_hyperparameters(self) -> None:
        """LR schedulers edit our param groups; the inner optimizer reads its own."""
        for group, inner in zip(self.param_groups, self.inner_optimizer.param_groups):
            for key, value in group.items():
                if key != "params":
                    inner[key] = value

    def _reduce_scatter_gradients(self) -> None:
        for group, layout, master in zip(self.param_groups, self._layouts, self._masters):
            grads = self._grads.grads(group["params"])  # one dtype: the params' or fp32
            flat = layout.flatten(grads, grads[0].dtype, master.device)  # a fresh buffer
            shard = collectives.reduce_scatter(flat, group=self.sharding_group)
            master.grad = shard.div_(self.sharding_size).to(master.dtype)

    def _clip_shard_gradients(self) -> torch.Tensor:
        """Clip through the shared TP/PP-aware ``nxd_layers.clip_grad_norm`` on shard pieces.

        Each piece stands for the slice of one parameter held here, carrying that parameter's
        tensor-parallel attributes (so TP-replicated slices count once). Pieces are disjoint
        across the sharding group and pipeline stages, so their norms are summed over the
        sharding group (or the DP x PP group joining it with the stages, one collective).
        """
        pieces = []
        for group, layout, master in zip(self.param_groups, self._layouts, self._masters):
            assert master.grad is not None
            for piece in layout.pieces(self.sharding_rank):
                span = slice(piece.shard_start, piece.shard_start + piece.numel)
                holder = master.detach()[span]
                holder.grad = master.grad[span]
                copy_tensor_model_parallel_attributes(holder, group["params"][piece.param_index])
                pieces.append(holder)
        if not pieces:  # this shard is all padding: contribute zero, but join the collectives
            holder = self._masters[0].detach()
            holder.grad = self._masters[0].grad
            holder.tensor_model_parallel = True  # type: ignore[attr-defined]
            pieces.append(holder)
        return clip_grad_norm(
            pieces,
            self.max_norm,
            self.norm_type,
            tensor_parallel_group=self.grad_norm_group,
            data_parallel_group=self._norm_reduce_group,
        )

    def _all_gather_params(self) -> None:
        for group, layout, master in zip(self.param_groups, self._layouts, self._masters):
            params = group["params"]
            full = collectives.all_gather(master.detach().to(params[0].dtype), self.sharding_group)
            layout.unflatten_into(full, params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads.zero(self._all_params(), set_to_none=set_to_none)
        for master in self._masters:
            master.grad = None

    def refresh_masters_from_params(self) -> None:
        """M_r <- shard r of flat(params): after the model's weights were loaded or changed."""
        with torch.no_grad():
            for group, layout, master in zip(self.param_groups, self._layouts, self._masters):
                flat = layout.flatten(
                    [p.detach() for p in group["params"]], master.dtype, master.device
                )
                master.copy_(layout.shard(flat, self.sharding_rank))

    def state_nbytes(self, *, include_master: bool = True) -> int:
        """Bytes of optimizer state held by this rank (and of the master shard)."""
        total = sum(
            value.numel() * value.element_size()
            for state in self.inner_optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        if include_master:
            total += sum(m.numel() * m.element_size() for m in self._masters)
        return total

    # State dicts and checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The local shard's state (``state``, ``param_groups``, ``shard`` metadata)."""
        return _zero1_checkpoint.local_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned on the same sharding rank and layout."""
        _zero1_checkpoint.load_local_state_dict(self, state_dict)

    def full_state_dict(self) -> dict[str, Any]:
        """The unsharded state, as a plain optimizer over the model's params would hold it
        (collective: every rank of the sharding group must call it)."""
        return _zero1_checkpoint.full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's shard of an unsharded state dict (any sharding size saved it)."""
        _zero1_checkpoint.load_full_state_dict(self, state_dict)

    def save_sharded_state_dict(self, output_dir: str | Path, save_serially: bool = True) -> None:
        """Every rank writes its shard to ``output_dir`` (safetensors + JSON)."""
        _zero1_checkpoint.save_sharded(self, Path(output_dir), save_serially=save_serially)

    def load_sharded_state_dict(
        self, output_dir: str | Path, num_workers_per_step: int = 8
    ) -> None:
        """Every rank reads its shard from ``output_dir``, ``num_workers_per_step`` at a time."""
        _zero1_checkpoint.load_sharded(self, Path(output_dir), num_workers_per_step)
