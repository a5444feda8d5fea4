"""EP-aware ZeRO-1: expert state sharded over the expert-DP group, the rest over DP x CP.

With expert parallelism (EP > 1) the n = DP·CP replicas of a dense parameter hold the same
weights, but the experts of a MoE layer are split over the EP group (EP consecutive DP ranks,
E/EP experts each): the ranks holding the *same* experts are the expert-DP group, of
m = n/EP ranks. So the params are split in two, each half its own
:class:`~nxd_optim.NeuronZero1Optimizer` (NxD's ``non_ep_zero_optimizer`` and
``ep_zero_optimizer``), and one step on rank r is

    G_d,r = (c/n) · (Σ_{DP x CP} flat(g_dense))_r        shard r of n (dense state / n)
    G_e,r = (c/n) · (Σ_{expert-DP} flat(g_expert))_r     shard r of m (expert state / m)
    ‖G‖^p = ‖Σ_{DP x CP} g_dense / n‖^p + ‖Σ_{expert-DP} g_expert / n‖^p   (max for p = ∞)
    c     = min(1, max_norm / (‖G‖ + ε))
    M <- inner_step(M, G), params <- all_gather(M) over each half's group

Both halves divide by n: a rank's expert gradient already sums, through the MoE all-to-all's
backward, the tokens of its whole EP group, and the expert-DP group's EP groups cover every
token once, so (1/n) Σ_expert-DP g_e is the whole batch's mean-loss gradient, the scale
:class:`~nxd_optim.NxDOptimizer` uses without ZeRO-1 (a mean over expert-DP alone, 1/m, would
be EP times too large). In the norm each expert counts once: its pieces are disjoint over
expert-DP (after a reduce-scatter) and different experts sit on the EP ranks, so the expert
share is summed over expert-DP x EP = DP x CP (over the EP group alone when the expert
gradients were all-reduced over expert-DP), never once per replica.

At EP = 1 (or without a parallel state) the expert-DP group is DP x CP: every param goes to
``non_ep_zero_optimizer`` and ``ep_zero_optimizer`` is None, i.e. plain ZeRO-1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from nxd_optim._grad_sync import is_expert_param
from nxd_optim._groups import GroupSpec, current_state_or_none, shard_norm_group
from nxd_optim._params import as_param_groups
from nxd_optim._zero1_norm import global_grad_norm
from nxd_optim.checkpoint_layout import ep_zero1_checkpoint_layout
from nxd_optim.zero1 import NeuronZero1Optimizer
from nxd_state.shards import FlatCheckpointLayout, RankContext

__all__ = ["NeuronEPZero1Optimizer"]

_FORMAT = "nxd-ep-zero1"
_STATE_KEYS = ("non_ep_zero_optimizer", "ep_zero_optimizer")


class _ExpertShardZero1(NeuronZero1Optimizer):
    """The expert half: ZeRO-1 over the expert-DP group. Its gradients are scaled and its
    norm summed by :class:`NeuronEPZero1Optimizer`, so it holds expert params at EP > 1."""

    _holds_expert_shards = True


class NeuronEPZero1Optimizer(NeuronZero1Optimizer):
    """NxD's EP-aware ZeRO-1: experts sharded over expert-DP, the rest over DP x CP, one norm.

    Same arguments as :class:`NeuronZero1Optimizer` (torch-xla's first). ``sharding_groups``
    may only be None or the data x context parallel groups (NxD refuses custom groups too):
    the expert half always shards over the current state's expert-DP group. Everything else
    (``grad_clipping``, ``max_norm``, ``norm_type``, master weights, fp32 accumulation, bucket
    caps, ``grad_reduction`` ...) applies to both halves. ``lazy_init=True`` builds the halves
    at :meth:`init_zero`.

    The halves are ``non_ep_zero_optimizer`` (dense params, DP x CP) and ``ep_zero_optimizer``
    (params marked ``expert_model_parallel``, expert-DP; None at EP = 1 or without experts);
    each keeps its own flat buckets, master shards and inner optimizer. ``param_groups`` are
    the caller's groups (both halves' params); LR schedulers edit them and the step copies the
    hyper-parameters into the halves. ``base_optimizer``, ``dtype_buckets`` and
    ``sharding_size`` / ``sharding_rank`` are per half (read them on the halves; here they
    raise when there are two).
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
        # Zero1Setup.__init__ is not called: the halves own the buckets; this object owns the
        # caller's param groups (Optimizer.__init__) and the step.
        groups = as_param_groups(params, "NeuronEPZero1Optimizer")
        self._inner_kwargs: dict[str, Any] = dict(
            optimizer_dtype=optimizer_dtype,
            grad_clipping=grad_clipping,
            max_norm=max_norm,
            pin_layout=pin_layout,
            grad_norm_groups=grad_norm_groups,
            bucket_cap_mb_all_gather=bucket_cap_mb_all_gather,
            bucket_cap_mb_reduce_scatter=bucket_cap_mb_reduce_scatter,
            use_grad_acc_hook=use_grad_acc_hook,
            save_master_weights=save_master_weights,
            higher_cc_precision=higher_cc_precision,
            norm_type=norm_type,
            use_master_weights=use_master_weights,
            use_fp32_grad_acc=use_fp32_grad_acc,
            use_master_weights_in_ckpt=use_master_weights_in_ckpt,
            grad_reduction=grad_reduction,
            parameters_as_bucket_view=parameters_as_bucket_view,
        )
        self.optimizer_class = optimizer_class
        self._expose_options(self._inner_kwargs)
        self._sharding_spec = sharding_groups
        self._grad_norm_spec = grad_norm_groups
        self._inner_defaults = dict(defaults)
        self._grad_norm: torch.Tensor | None = None
        self.non_ep_zero_optimizer: NeuronZero1Optimizer | None = None
        self.ep_zero_optimizer: NeuronZero1Optimizer | None = None
        # Per caller group: its index in each half's param groups (None: no params there).
        self._group_map: list[tuple[int | None, int | None]] = []
        self.inited = False
        Optimizer.__init__(self, groups, defaults)
        if not lazy_init:
            self.init_zero()

    def _expose_options(self, options: dict[str, Any]) -> None:
        """torch-xla's option attributes (as :class:`NeuronZero1Optimizer` has them), from the
        arguments both halves are built with."""
        self.grad_clipping = options["grad_clipping"]
        max_norm = options["max_norm"]
        self.max_norm = 1.0 if max_norm is None else float(max_norm)
        self.norm_type = float(options["norm_type"])
        self.pin_layout = options["pin_layout"]
        self.use_master_weights = options["use_master_weights"]
        self.use_fp32_grad_acc = self.use_grad_acc_hook = (
            options["use_fp32_grad_acc"] or options["use_grad_acc_hook"]
        )
        self.use_master_weights_in_ckpt = self.save_master_weights = (
            options["use_master_weights_in_ckpt"] or options["save_master_weights"]
        )
        self.higher_cc_precision = options["higher_cc_precision"]
        self.grad_reduction = options["grad_reduction"]

    # Set-up ----------------------------------------------------------------------------
    def init_zero(self) -> None:
        """Split every param group into its dense and expert params and build the halves
        (collective). Called by the constructor unless ``lazy_init=True``."""
        self._check_sharding_spec()
        state = current_state_or_none()
        split = state is not None and state.expert_model_parallel_size > 1
        dense_groups: list[dict[str, Any]] = []
        expert_groups: list[dict[str, Any]] = []
        self._group_map = []
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            experts = [p for p in group["params"] if split and is_expert_param(p)]
            dense = [p for p in group["params"] if not (split and is_expert_param(p))]
            indices: list[int | None] = []
            for members, target in ((dense, dense_groups), (experts, expert_groups)):
                indices.append(len(target) if members else None)
                if members:
                    target.append({**hyper, "params": members})
            self._group_map.append((indices[0], indices[1]))
        if self.non_ep_zero_optimizer is not None:
            self.non_ep_zero_optimizer.remove_hooks()
        if self.ep_zero_optimizer is not None:
            self.ep_zero_optimizer.remove_hooks()
        self.non_ep_zero_optimizer = self.ep_zero_optimizer = None
        if dense_groups:
            self.non_ep_zero_optimizer = NeuronZero1Optimizer(
                dense_groups,
                self.optimizer_class,
                sharding_groups=state.data_context_parallel_group if state else None,
                **self._inner_kwargs,
                **self._inner_defaults,
            )
        if expert_groups:
            assert state is not None
            self.ep_zero_optimizer = _ExpertShardZero1(
                expert_groups,
                self.optimizer_class,
                sharding_groups=state.expert_data_parallel_group,
                **self._inner_kwargs,
                **self._inner_defaults,
            )
        self._adopt_half_hyperparameters()
        self.inited = True

    def flat_checkpoint_layout(self, ctx: RankContext) -> FlatCheckpointLayout:
        """Both halves' flat layouts, each checked against ``ctx``'s groups, for checkpoints
        (:mod:`nxd_optim.checkpoint_layout`)."""
        return ep_zero1_checkpoint_layout(self, ctx)

    def _check_sharding_spec(self) -> None:
        """None, or the DP x CP groups (as a ProcessGroup or NxD's ``as_list`` form)."""
        spec = self._sharding_spec
        if spec is None:
            return
        state = current_state_or_none()
        if state is None:
            raise RuntimeError(
                "NeuronEPZero1Optimizer needs the nxd_state parallel state (its expert-DP "
                "group): call nxd_state.initialize_model_parallel(...) first"
            )
        expected = state.layout.data_context_parallel_groups()
        given: list[int] | list[list[int]]
        if isinstance(spec, ProcessGroup):
            given = list(dist.get_process_group_ranks(spec))
            if sorted(given) == sorted(state.data_context_parallel_ranks):
                return
        else:
            lists = [sorted(int(r) for r in g) for g in spec]
            if sorted(lists) == sorted(sorted(g) for g in expected):
                return
            given = [list(g) for g in spec]
        raise ValueError(
            f"NeuronEPZero1Optimizer: sharding_groups {given} are not the data x context "
            f"parallel groups {expected}; custom sharding groups are not supported with "
            f"expert parallelism (dense params shard over DP x CP, experts over expert-DP)"
        )

    def _halves(self) -> list[NeuronZero1Optimizer]:
        return [h for h in (self.non_ep_zero_optimizer, self.ep_zero_optimizer) if h is not None]

    def _half_groups(self) -> list[tuple[dict[str, Any], NeuronZero1Optimizer, int]]:
        """(caller group, half, index of its part in the half) for every part."""
        out = []
        for group, indices in zip(self.param_groups, self._group_map, strict=True):
            for half, index in zip((self.non_ep_zero_optimizer, self.ep_zero_optimizer), indices):
                if half is not None and index is not None:
                    out.append((group, half, index))
        return out

    def _sync_to_halves(self) -> None:
        """Caller groups' hyper-parameters (an LR scheduler's edits) into the halves."""
        for group, half, index in self._half_groups():
            target = half.param_groups[index]
            for key, value in group.items():
                if key != "params":
                    target[key] = value

    def _adopt_half_hyperparameters(self) -> None:
        """The halves' hyper-parameters (the inner optimizer's defaults, loaded values) into
        the caller groups; both halves of a group hold the same values."""
        for group, half, index in self._half_groups():
            for key, value in half.param_groups[index].items():
                if key != "params":
                    group[key] = value
        for half in self._halves():
            for key, value in half.defaults.items():
                self.defaults.setdefault(key, value)

    def _state(self) -> Any:
        state = current_state_or_none()
        if state is None:
            raise RuntimeError("NeuronEPZero1Optimizer: the nxd_state parallel state is gone")
        return state

    # The step ------------------------------------------------------------------------
    def gradients(self) -> list[torch.Tensor]:
        """Every param's local gradient (or accumulator), in the caller groups' order."""
        self._check_inited("gradients")
        by_param: dict[int, torch.Tensor] = {}
        for half in self._halves():
            by_param.update(zip(map(id, half._all_params()), half.gradients()))
        return [by_param[id(p)] for p in self._all_params()]

    def scale_gradients(self, factor: float) -> None:
        """G <- factor · G in both halves (see :meth:`NeuronZero1Optimizer.scale_gradients`)."""
        self._check_inited("scale_gradients")
        for half in self._halves():
            half.scale_gradients(factor)

    def zero_grad(self, set_to_none: bool = False) -> None:
        if not self.inited:
            Optimizer.zero_grad(self, set_to_none=set_to_none)
            return
        for half in self._halves():
            half.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self._check_inited("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_to_halves()
        reduced = []
        for half in self._halves():
            half._sync_hyperparameters()
            reduced.append(half._reduce_gradients())  # Σ over each half's sharding group
        divisor = self._replicas()
        coef = None
        if self.grad_clipping:
            self._grad_norm = self._combined_norm(reduced) / divisor
            coef = self._clip_coefficient(self._grad_norm)
        for half, sums in zip(self._halves(), reduced):
            half._step_reduced(sums, coef, divisor)  # both halves: Σ / (DP·CP)
        return loss

    def _replicas(self) -> int:
        """n = DP·CP: the divisor of both halves' sums (module docstring)."""
        state = current_state_or_none()
        if state is not None:
            return state.data_context_parallel_size
        assert self.non_ep_zero_optimizer is not None  # no state: one half, no experts
        return self.non_ep_zero_optimizer.sharding_size

    def _combined_norm(self, reduced: Sequence[list[Any]]) -> torch.Tensor:
        """‖[Σ g_dense, Σ g_expert]‖_p, each half's share reduced over the ranks holding
        disjoint parts of it, then combined (not yet divided by n)."""
        norms = []
        for half, sums in zip(self._halves(), reduced):
            spans, whole = half._grad_spans(sums)
            pipeline = half._pipeline_group if whole else None
            if half is self.ep_zero_optimizer:
                # Experts differ over EP: sum there; pieces (reduce-scatter) also differ over
                # expert-DP, and expert-DP x EP = DP x CP (x PP: one collective, as dense).
                state = self._state()
                if whole:
                    data = state.expert_model_parallel_group
                else:
                    ranks = state.data_context_parallel_ranks
                    data = shard_norm_group(ranks) or state.data_context_parallel_group
            else:
                data = None if whole else half._norm_reduce_group
            norms.append(
                global_grad_norm(
                    spans,
                    self.norm_type,
                    tensor_parallel_group=half.grad_norm_group,
                    pipeline_parallel_group=pipeline,
                    data_parallel_group=data,
                )
            )
        stacked = torch.stack([n.reshape(()) for n in norms])
        return torch.linalg.vector_norm(stacked, self.norm_type)

    @torch.no_grad()
    def allgather_weights_and_update_full_parameter(self) -> None:
        """params <- all_gather(M) in each half, over its own group."""
        self._check_inited("allgather_weights_and_update_full_parameter")
        for half in self._halves():
            half.allgather_weights_and_update_full_parameter()

    def refresh_masters_from_params(self) -> None:
        self._check_inited("refresh_masters_from_params")
        for half in self._halves():
            half.refresh_masters_from_params()

    def remove_hooks(self) -> None:
        for half in self._halves():
            half.remove_hooks()

    def state_nbytes(self, *, include_master: bool = True) -> int:
        return sum(h.state_nbytes(include_master=include_master) for h in self._halves())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.inited:
            raise NotImplementedError(
                "NeuronEPZero1Optimizer.add_param_group after init_zero(): the halves' flat "
                "buckets are built; pass every group to the constructor (or use lazy_init=True "
                "and add groups before init_zero())"
            )
        Optimizer.add_param_group(self, param_group)

    # Attributes that exist once per half ---------------------------------------------
    def _per_half(self, name: str) -> RuntimeError:
        return RuntimeError(
            f"NeuronEPZero1Optimizer.{name}: there is one per half, read "
            f"non_ep_zero_optimizer.{name} (dense params, sharded over DP x CP) and "
            f"ep_zero_optimizer.{name} (expert params, sharded over the expert-DP group)"
        )

    def _single_half(self, name: str) -> NeuronZero1Optimizer:
        """The only half (EP = 1 or no experts), whose attribute is then this optimizer's."""
        self._check_inited(name)
        halves = self._halves()
        if len(halves) != 1:
            raise self._per_half(name)
        return halves[0]

    @property
    def base_optimizer(self) -> Optimizer:
        return self._single_half("base_optimizer").base_optimizer

    @property
    def inner_optimizer(self) -> Optimizer:
        return self.base_optimizer

    @property
    def dtype_buckets(self) -> tuple[Any, ...]:
        return self._single_half("dtype_buckets").dtype_buckets

    @property
    def sharding_size(self) -> int:  # type: ignore[override]
        return self._single_half("sharding_size").sharding_size

    @property
    def sharding_rank(self) -> int:  # type: ignore[override]
        return self._single_half("sharding_rank").sharding_rank

    @property
    def local_world_size(self) -> int:
        return self.sharding_size

    @property
    def local_rank(self) -> int:
        return self.sharding_rank

    @property
    def sharding_groups(self) -> Any:
        """The dense half's sharding groups as given, or the DP x CP groups (NxD's)."""
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
    def optimizer_dtype(self) -> torch.dtype | None:
        dtypes = {h.optimizer_dtype for h in self._halves()}
        return dtypes.pop() if len(dtypes) == 1 else None

    # State --------------------------------------------------------------------------
    def _expert_parallel_meta(self) -> dict[str, Any]:
        state = current_state_or_none()
        return {
            "format": _FORMAT,
            "expert_model_parallel_size": state.expert_model_parallel_size if state else 1,
            "expert_model_parallel_rank": state.expert_model_parallel_rank if state else 0,
            "data_context_parallel_size": self._replicas(),
            "group_map": [list(pair) for pair in self._group_map],
        }

    def state_dict(self) -> dict[str, Any]:
        """``{"non_ep_zero_optimizer": dense half's state_dict() or None, "ep_zero_optimizer":
        expert half's or None, "expert_parallel": {format, EP size and rank, DP·CP size,
        group_map}}``; each half's is :meth:`NeuronZero1Optimizer.state_dict` of its shard."""
        self._check_inited("state_dict")
        self._sync_to_halves()
        out: dict[str, Any] = {"expert_parallel": self._expert_parallel_meta()}
        for key, half in zip(_STATE_KEYS, (self.non_ep_zero_optimizer, self.ep_zero_optimizer)):
            out[key] = half.state_dict() if half is not None else None
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned on the same rank at the same degrees (EP,
        DP x CP, TP, PP); refused with the mismatch named otherwise."""
        self._check_inited("load_state_dict")
        saved = state_dict.get("expert_parallel")
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
            raise ValueError(
                "NeuronEPZero1Optimizer.load_state_dict: not a state dict of this optimizer "
                f"(no 'expert_parallel' entry of format {_FORMAT!r}); keys {sorted(state_dict)}"
            )
        mine = self._expert_parallel_meta()
        for key, value in mine.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"NeuronEPZero1Optimizer.load_state_dict: saved with {key}="
                    f"{saved.get(key)!r}, this optimizer has {key}={value!r}; sharded state "
                    f"loads only at the same expert/data parallel degrees, rank and groups"
                )
        for key, half in zip(_STATE_KEYS, (self.non_ep_zero_optimizer, self.ep_zero_optimizer)):
            if (state_dict.get(key) is None) != (half is None):
                raise ValueError(f"NeuronEPZero1Optimizer.load_state_dict: {key} mismatch")
            if half is not None:
                half.load_state_dict(state_dict[key])
        self._adopt_half_hyperparameters()

    def full_state_dict(self) -> dict[str, Any]:
        """Each half's :meth:`NeuronZero1Optimizer.full_state_dict` (collective over its
        group): the dense state whole, the expert state of this EP rank's experts whole."""
        self._check_inited("full_state_dict")
        self._sync_to_halves()
        out: dict[str, Any] = {"expert_parallel": self._expert_parallel_meta()}
        for key, half in zip(_STATE_KEYS, (self.non_ep_zero_optimizer, self.ep_zero_optimizer)):
            out[key] = half.full_state_dict() if half is not None else None
        return out

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_inited("load_full_state_dict")
        for key, half in zip(_STATE_KEYS, (self.non_ep_zero_optimizer, self.ep_zero_optimizer)):
            if half is not None:
                half.load_full_state_dict(state_dict[key])
        self._adopt_half_hyperparameters()

    def _half_dirs(self, output_dir: Path) -> list[tuple[NeuronZero1Optimizer, Path]]:
        """``non_ep/`` for the dense half, ``ep{EP rank:02d}/`` for the expert half: the EP
        ranks' expert shards differ, so each EP rank's expert-DP group has its own folder."""
        out = []
        if self.non_ep_zero_optimizer is not None:
            out.append((self.non_ep_zero_optimizer, output_dir / "non_ep"))
        if self.ep_zero_optimizer is not None:
            rank = self._state().expert_model_parallel_rank
            out.append((self.ep_zero_optimizer, output_dir / f"ep{rank:02d}"))
        return out

    def save_sharded_state_dict(self, output_dir: str | Path, save_serially: bool = True) -> None:
        """Each half writes its shards (safetensors + JSON) under its folder (see
        :meth:`_half_dirs`)."""
        self._check_inited("save_sharded_state_dict")
        self._sync_to_halves()
        for half, folder in self._half_dirs(Path(output_dir)):
            folder.mkdir(parents=True, exist_ok=True)
            half.save_sharded_state_dict(folder, save_serially=save_serially)

    def load_sharded_state_dict(
        self, output_dir: str | Path, num_workers_per_step: int = 8
    ) -> None:
        self._check_inited("load_sharded_state_dict")
        for half, folder in self._half_dirs(Path(output_dir)):
            half.load_sharded_state_dict(folder, num_workers_per_step)
        self._adopt_half_hyperparameters()

    def __repr__(self) -> str:
        return (
            f"NeuronEPZero1Optimizer(non_ep_zero_optimizer={self.non_ep_zero_optimizer!r}, "
            f"ep_zero_optimizer={self.ep_zero_optimizer!r})"
        )
