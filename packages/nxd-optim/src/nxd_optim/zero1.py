"""ZeRO-1 on every backend: optimizer state sharded over the data-parallel group.

The params of each param group are split by dtype into buckets (see :mod:`nxd_optim._buckets`)
and each bucket is flattened into a padded buffer F (see :class:`FlatLayout`). With n ranks in
the sharding group, one step on rank r is, per bucket,

    G_r = (1/n) · (Σ_k flat(grads)^(k))_r            the averaged gradient of shard r
    G_r <- G_r · min(1, max_norm / ‖G‖)                 ‖G‖ over all buckets, shards, TP and PP
    M_r <- inner_optimizer.step(M_r, G_r)               M_r: master shard (optimizer dtype)
    params <- unflatten(all_gather(cast(M_r)))          every rank gets every updated shard

so each rank keeps 1/n of the optimizer state (and of the fp32 master weights). The sum is a
reduce-scatter, or on gloo at 2 ranks an all-reduce and a slice (see
:mod:`nxd_optim._zero1_comm`). On CPU and CUDA the params are views of their bucket's flat
buffer, which the all-gather fills in place (see :mod:`nxd_optim._param_views`). Any
``torch.optim.Optimizer`` class works as the inner optimizer: it only ever sees one flat tensor
per bucket.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from nxd_optim._buckets import DtypeBucket
from nxd_optim._groups import GroupSpec
from nxd_optim._mixed_precision import GradientStore
from nxd_optim._params import as_param_groups
from nxd_optim._zero1_base import Zero1Setup
from nxd_optim._zero1_comm import all_gather_flat, all_gather_flat_into, reduce_flat
from nxd_optim._zero1_norm import GradSpan, global_grad_norm
from nxd_optim.checkpoint_layout import zero1_checkpoint_layout
from nxd_state.shards import FlatCheckpointLayout, RankContext

__all__ = ["NeuronZero1Optimizer", "as_param_groups"]

logger = logging.getLogger(__name__)

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ and torch-xla do.
_CLIP_EPS = 1e-6


class NeuronZero1Optimizer(Zero1Setup):
    """M_r <- step(M_r, (1/n)·Σ_k g_r^(k)), θ <- all_gather(M_r): NxD's ZeRO-1.

    NxD's ``NeuronZero1Optimizer`` (torch-xla's ``ZeroRedundancyOptimizer``) name, arguments
    and attributes, on any backend: ``base_optimizer`` (the inner optimizer over the master
    shards), ``grad_norm``, ``sharding_groups`` / ``grad_norm_groups``, ``optimizer_dtype``,
    ``grad_clipping``, ``max_norm``, ``local_world_size`` / ``local_rank``, ``inited`` /
    ``init_zero()`` (with ``lazy_init=True``), ``allgather_weights_and_update_full_parameter()``,
    ``get_shape_info()``. It does not sum sequence-parallel gradients over TP
    (:class:`~nxd_optim.NxDOptimizer` does, before calling it).

    Arguments, torch-xla's first:

    * ``sharding_groups`` / ``grad_norm_groups``: a ``ProcessGroup`` or NxD's ``as_list`` form;
      by default the current parallel state's data-parallel and tensor-parallel groups.
    * ``grad_clipping``, ``max_norm`` (``None`` means 1.0, as in torch-xla), ``norm_type``:
      clip the norm of the whole model's gradient (over the shards, TP and PP);
      ``max_norm=math.inf`` measures it (``grad_norm``) and scales nothing.
    * ``optimizer_dtype``: dtype of the master shards and the optimizer state; by default
      float32 for bf16/fp16 params when ``use_master_weights`` (fp32 master weights), else the
      params' own dtype.
    * ``lazy_init``: shard nothing until :meth:`init_zero` (``sharding_groups`` may change
      until then).
    * ``bucket_cap_mb_reduce_scatter`` / ``bucket_cap_mb_all_gather``: if positive, no
      collective moves more than this many MiB (a bucket is moved in column blocks); 0 moves
      each dtype bucket in one collective.
    * ``use_grad_acc_hook`` (= ``use_fp32_grad_acc``): accumulate micro-batch gradients in
      buffers of the optimizer dtype (fp32 by default), freeing ``p.grad`` after each backward.
    * ``save_master_weights`` (= ``use_master_weights_in_ckpt``): put the master shards in
      state dicts; otherwise they are rebuilt from the model's params on load.
    * ``higher_cc_precision``: reduce gradients in the optimizer dtype instead of their own.
    * ``pin_layout``: accepted for NxD compatibility, no effect.
    * ``grad_reduction`` (nxd): ``"auto"`` (all-reduce + slice on gloo at 2 ranks,
      reduce-scatter otherwise; see :mod:`nxd_optim._zero1_comm`), ``"reduce_scatter"`` or
      ``"all_reduce"``.
    * ``parameters_as_bucket_view`` (nxd, torch ZeRO's name): on CPU and CUDA, point each
      param's ``.data`` at its slice of its bucket's flat buffer, which the all-gather fills in
      place (see :mod:`nxd_optim._param_views`); False keeps the params' own storage and
      copies the gathered buffer into them. Ignored on XLA.
    * ``**defaults``: the inner optimizer's hyper-parameters (``lr``, ``betas`` ...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        optimizer_dtype: torch.dtype | None = None,
        grad_clipping: bool = True,
        max_norm: float | None = None,
        pin_layout: bool = True,
        sharding_groups: GroupSpec = None,
        grad_norm_groups: GroupSpec = None,
        lazy_init: bool = False,
        bucket_cap_mb_all_gather: float = 0,
        bucket_cap_mb_reduce_scatter: float = 0,
        use_grad_acc_hook: bool = False,
        save_master_weights: bool = False,
        higher_cc_precision: bool = False,
        *,
        norm_type: float = 2.0,
        use_master_weights: bool = True,
        use_fp32_grad_acc: bool = False,
        use_master_weights_in_ckpt: bool = False,
        grad_reduction: str = "auto",
        parameters_as_bucket_view: bool = True,
        **defaults: Any,
    ) -> None:
        super().__init__(
            params,
            optimizer_class,
            optimizer_dtype=optimizer_dtype,
            grad_clipping=grad_clipping,
            max_norm=max_norm,
            norm_type=norm_type,
            pin_layout=pin_layout,
            sharding_groups=sharding_groups,
            grad_norm_groups=grad_norm_groups,
            bucket_cap_mb_all_gather=bucket_cap_mb_all_gather,
            bucket_cap_mb_reduce_scatter=bucket_cap_mb_reduce_scatter,
            use_master_weights=use_master_weights,
            fp32_grad_acc=use_fp32_grad_acc or use_grad_acc_hook,
            master_weights_in_ckpt=use_master_weights_in_ckpt or save_master_weights,
            higher_cc_precision=higher_cc_precision,
            grad_reduction=grad_reduction,
            parameters_as_bucket_view=parameters_as_bucket_view,
            defaults=defaults,
        )
        if not lazy_init:
            self.init_zero()

    def flat_checkpoint_layout(self, ctx: RankContext) -> FlatCheckpointLayout:
        """The flat layout of the state, for checkpoints (:mod:`nxd_optim.checkpoint_layout`,
        the protocol :class:`nxd_state.shards.FlatShardedState`)."""
        return zero1_checkpoint_layout(self, ctx, exact=type(self) is NeuronZero1Optimizer)

    # The step ------------------------------------------------------------------------
    @property
    def grad_norm(self) -> torch.Tensor | None:
        """‖G‖ before clipping at the last step; None before the first or without clipping.
        With ``max_norm=math.inf`` the norm is measured and nothing is scaled."""
        return self._grad_norm

    def gradients(self) -> list[torch.Tensor]:
        """Every param's local gradient (p.grad or its accumulator), in place-editable; a
        param without one gets a zero gradient (allocated)."""
        self._check_inited("gradients")
        return self._store().grads(self._all_params())

    def scale_gradients(self, factor: float) -> None:
        """G <- factor · G for the gradients accumulated for the coming :meth:`step`, in place.

        k micro-batches accumulate G = Σ_i ∇L_i; ``factor = 1/k`` makes G their mean, the
        gradient of the mean loss. The reductions between backward and step (the sum over the
        sharding group; under :class:`~nxd_optim.NxDOptimizer` the sequence-parallel sum over
        TP) are linear, so this equals scaling every micro-batch's loss by ``factor``; clipping
        and ``grad_norm`` then see the scaled gradient. Call it after the last backward and
        before :meth:`step`.

        The gradients are scaled where they wait for the step: ``p.grad``, or the accumulators
        of ``use_fp32_grad_acc`` / ``use_grad_acc_hook`` (where ``p.grad`` is None). bf16/fp16
        ``p.grad`` is rounded once to its dtype (exact for powers of two). Local: no collective,
        no allocation. ``factor`` must be finite; 1.0 does nothing.
        """
        self._check_inited("scale_gradients")
        self._store().scale(self._all_params(), factor, "NeuronZero1Optimizer.scale_gradients")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self._check_inited("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        reduced = self._reduce_gradients()
        coef = None
        if self.grad_clipping:
            self._grad_norm = self._global_grad_norm(reduced)
            coef = self._clip_coefficient(self._grad_norm)
        self._step_reduced(reduced, coef, self.sharding_size)
        return loss

    def _clip_coefficient(self, norm: torch.Tensor) -> torch.Tensor | None:
        """min(1, max_norm / (‖G‖ + ε)); None with ``max_norm = inf`` (measure only)."""
        if not math.isfinite(self.max_norm):
            return None
        return torch.clamp(self.max_norm / (norm + _CLIP_EPS), max=1.0)

    def _step_reduced(
        self,
        reduced: list[tuple[torch.Tensor, torch.Tensor | None]],
        coef: torch.Tensor | None,
        divisor: int,
    ) -> None:
        """G_r <- (c / divisor) · Σ_k g_r^(k) per bucket, step the master shards, gather the
        params. ``reduced`` (the summed shards of :meth:`_reduce_gradients`) is emptied, which
        frees the full-size reduction buffers before the inner step."""
        for bucket, (shard, _) in zip(self._buckets, reduced):
            grad = shard.to(bucket.master.dtype)
            if coef is None:
                grad.div_(divisor)
            else:  # the mean and the clipping factor in one pass over the shard: g · (c / n)
                grad.mul_(coef.to(grad.dtype) / divisor)
            bucket.master.grad = grad
        reduced.clear()  # the full-size reduction buffers
        self.base_optimizer.step()
        self.base_optimizer.zero_grad(set_to_none=True)  # free the gradient shards now
        self.allgather_weights_and_update_full_parameter()

    def _sync_hyperparameters(self) -> None:
        """LR schedulers edit our param groups; the inner optimizer reads its own."""
        for group, inner in zip(self.param_groups, self._inner_optimizer().param_groups):
            for key, value in group.items():
                if key != "params":
                    inner[key] = value

    def _reduce_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per bucket ``(Σ_k shard, Σ_k flat or None)``: summed, not yet averaged."""
        reduced = []
        for bucket in self._buckets:
            grads = self._store().grads(self._bucket_params(bucket))  # one dtype per bucket
            dtype = bucket.master.dtype if self.higher_cc_precision else grads[0].dtype
            flat = bucket.layout.flatten(
                grads, dtype, bucket.master.device, out=self._reduce_buffer(bucket, dtype)
            )
            reduced.append(
                reduce_flat(flat, self.sharding_group, self._reduction, self._reduce_cap_numel)
            )
        return reduced

    @staticmethod
    def _reduce_buffer(bucket: DtypeBucket, dtype: torch.dtype) -> torch.Tensor | None:
        """The flat gradient buffer to reduce in: on CPU one kept between steps, elsewhere
        None (a temporary). A fresh multi-MB CPU allocation is a fresh memory mapping whose
        pages fault on first touch, and freeing it lets the allocator return memory the
        optimizer's own temporaries then fault in again: on the benchmark's 2.4 MB model,
        ~900 page faults per step and a third of the step's CPU time in the calling thread
        (DP=2). Kept, it costs one bucket's gradient bytes between steps. CUDA's caching
        allocator has no such cost, so there the buffer stays a temporary."""
        if bucket.master.device.type != "cpu":
            return None
        buffer = bucket.reduce_buffer
        if buffer is None or buffer.dtype != dtype:
            buffer = torch.empty(bucket.layout.padded_numel, dtype=dtype)
            bucket.reduce_buffer = buffer
        return buffer

    def _global_grad_norm(
        self, reduced: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> torch.Tensor:
        """‖(1/n) Σ_k g^(k)‖ over the whole model (see :mod:`nxd_optim._zero1_norm`).

        After an all-reduce every rank holds the whole gradient: every param is a span and
        the norm is reduced over TP and PP only. After a reduce-scatter each rank holds
        disjoint pieces: their norms are also summed over the sharding group (or the DP x PP
        group joining it with the stages, one collective).
        """
        spans, whole = self._grad_spans(reduced)
        norm = global_grad_norm(
            spans,
            self.norm_type,
            tensor_parallel_group=self.grad_norm_group,
            pipeline_parallel_group=self._pipeline_group if whole else None,
            data_parallel_group=None if whole else self._norm_reduce_group,
        )
        return norm / self.sharding_size

    def _grad_spans(
        self, reduced: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> tuple[list[GradSpan], bool]:
        """The gradient slices this rank counts in the norm, and whether they are whole params
        (every bucket all-reduced: no sum over the sharding group needed)."""
        whole = all(full is not None for _, full in reduced)
        spans = []
        for bucket, (shard, full) in zip(self._buckets, reduced):
            params, layout = self._bucket_params(bucket), bucket.layout
            if full is not None and whole:
                for param, start, numel in zip(params, layout.offsets, layout.numels):
                    spans.append(GradSpan(full[start : start + numel], param))
            else:
                for piece in layout.pieces(self.sharding_rank):
                    view = shard[piece.shard_start : piece.shard_start + piece.numel]
                    spans.append(GradSpan(view, params[piece.param_index], piece.param_start))
        if not spans:  # this shard is all padding: contribute zero, but join the collectives
            spans.append(GradSpan(reduced[0][0], None))
        return spans, whole

    @torch.no_grad()
    def allgather_weights_and_update_full_parameter(self) -> None:
        """params <- unflatten(all_gather(M_r)) for every bucket (torch-xla's name).

        With params bound as views of the bucket's buffer F: F_r <- M_r (cast), F filled in
        place by the all-gather, and only params that stopped viewing F get a copy."""
        self._check_inited("allgather_weights_and_update_full_parameter")
        for bucket in self._buckets:
            params = self._bucket_params(bucket)
            if bucket.views is None:
                source = bucket.master.detach().to(bucket.dtype)
                full = all_gather_flat(source, self.sharding_group, self._gather_cap_numel)
                bucket.layout.unflatten_into(full, params)
                continue
            flat = bucket.views.flat
            bucket.layout.shard(flat, self.sharding_rank).copy_(bucket.master)
            all_gather_flat_into(flat, self.sharding_group, self._gather_cap_numel)
            bucket.views.update_detached(params)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clear the params' gradients (and accumulators); torch-xla's default keeps the
        gradient tensors, zeroed."""
        if not self.inited:
            super().zero_grad(set_to_none=set_to_none)
            return
        self._store().zero(self._all_params(), set_to_none=set_to_none)
        for bucket in self._buckets:
            bucket.master.grad = None

    def state_nbytes(self, *, include_master: bool = True) -> int:
        """Bytes of optimizer state held by this rank (and of the master shards)."""
        total = sum(
            value.numel() * value.element_size()
            for state in self.base_optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        if include_master:
            total += sum(b.master.numel() * b.master.element_size() for b in self._buckets)
        return total

    def _store(self) -> GradientStore:
        assert self._grads is not None
        return self._grads
