"""NxDPPModel: NxD's pipeline-parallel wrapper.

``NxDPPModel(module, ...)`` captures the model's graph, cuts it into ``p·v`` stages, keeps only
this rank's stages (materialising their parameters if the model was built on the meta device),
and runs a schedule in ``run_train`` / ``run_eval``. With ``manual_pp_partition=True`` the model
is a list of layers instead, split into stages without any capture (:mod:`nxd_pipeline._manual`).
After a training step the gradients of parameters shared by several pipeline ranks (tied
embeddings) are summed over the pipeline group and, unless an optimizer wrapper or ZeRO-1 takes
over, averaged over the data-parallel group (expert weights at EP > 1 over the expert-DP
group, with the same divisor DP x CP); each call reduces only its own gradients, so calls
accumulate (:mod:`nxd_pipeline._reduce`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import ModuleType
from typing import Any, cast

import torch
from torch import fx, nn

from nxd_pipeline._arguments import check_arguments
from nxd_pipeline._build import PartitionFn, build_manual, build_traced
from nxd_pipeline._inputs import signature, split_manual, split_traced
from nxd_pipeline._local import LocalStagesMixin
from nxd_pipeline._loss import LossSpec, select_loss
from nxd_pipeline._materialize import move_local_tensors
from nxd_pipeline._reduce import DataParallelReduction, GradientReducer, sync_tied_weights
from nxd_pipeline._runtime import Stage, StepRunner
from nxd_pipeline._schedules import build_schedule, stage_to_rank
from nxd_pipeline._timeline import Timeline
from nxd_state import ParallelState, collectives, get_parallel_state

__all__ = ["NxDPPModel"]

logger = logging.getLogger(__name__)


class NxDPPModel(LocalStagesMixin, nn.Module):
    """Pipeline-parallel wrapper with NxD's signature (see the package README).

    ``module`` is a model to capture and cut at ``pipeline_cuts``, or, with
    ``manual_pp_partition=True``, a list of layers (NxD's manual mode: stages from
    ``manual_pp_stage_partition_fn``, loss from ``manual_pp_loss_fn``, inputs passed as
    ``run_train(inputs=..., labels=...)``). ``return_loss_on_cpu`` (NxD's default True) returns
    the loss on the CPU.

    NxD's keyword arguments outside its documented signature: ``virtual_pipeline_size``
    (model chunks per rank, interleaving), ``use_optimizer_wrapper`` (True: an optimizer
    wrapper averages gradients over DP at its step, so ``run_train`` does not) and
    ``use_model_wrapper`` (True: a model wrapper materialises the local parameters and moves
    them to the device by calling :meth:`move_model_to_device`; else that happens here).
    NxD's XLA runtime knobs (``_all_reduce_send_recv``, ``fuse_microbatches``...) are accepted
    and have no effect. Beyond NxD: ``schedule`` (``"1f1b"`` default, ``"gpipe"``,
    ``"interleaved_1f1b"`` (default when v > 1), ``"zb_h1"``), ``device`` (where local stages
    live; default: where the model's parameters are, or CPU for a meta model) and
    ``async_sends`` (non-blocking p2p: sends left in flight, receives waited for only where
    their data is used, instead of synchronous batches; default: on for gloo only).
    """

    original_torch_module: nn.Module | Sequence[nn.Module]
    """The model (or layer list) given, as NxD keeps it; not a submodule: ``parameters()``
    and ``state_dict()`` of this wrapper hold this rank's stages only."""

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        transformer_layer_cls: type | str | None = None,
        num_microbatches: int = 1,
        virtual_pipeline_size: int = 1,
        output_loss_value_spec: LossSpec = None,
        return_mb_loss: bool = False,
        broadcast_and_average_loss: bool = False,
        use_zero1_optimizer: bool = False,
        use_model_wrapper: bool = False,
        use_optimizer_wrapper: bool = False,
        pipeline_cuts: list[str] | None = None,
        input_names: list[str] | None = None,
        leaf_module_cls: list[type | str] | None = None,
        autowrap_functions: tuple[Callable[..., Any], ...] | None = None,
        autowrap_modules: tuple[ModuleType, ...] | None = None,
        autowrap_obj_methods: Mapping[Any, Sequence[str]] | None = None,
        tracer_cls: str | type[fx.Tracer] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        trace_file_path: str | None = None,
        return_loss_on_cpu: bool | None = True,
        deallocate_pipeline_outputs: bool = False,
        auto_partition: bool | None = False,
        fuse_microbatches: bool | None = False,
        manual_pp_partition: bool | None = False,
        manual_pp_stage_partition_fn: PartitionFn | None = None,
        manual_pp_loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        _debug_mode: bool = False,
        _debug_pp_size: int = 8,
        _debug_pp_rank: int = 0,
        schedule: str | None = None,
        device: torch.device | str | None = None,
        async_sends: bool | None = None,
        **xla_runtime_options: Any,
    ) -> None:
        super().__init__()
        check_arguments(
            module,
            num_microbatches=num_microbatches,
            virtual_pipeline_size=virtual_pipeline_size,
            return_mb_loss=return_mb_loss,
            broadcast_and_average_loss=broadcast_and_average_loss,
            pipeline_cuts=pipeline_cuts,
            auto_partition=bool(auto_partition),
            output_loss_value_spec=output_loss_value_spec,
            manual_pp_partition=bool(manual_pp_partition),
            manual_options=(manual_pp_loss_fn, manual_pp_stage_partition_fn),
            debug=(_debug_mode, _debug_pp_size, _debug_pp_rank),
            xla_runtime_options=xla_runtime_options,
        )
        if deallocate_pipeline_outputs:  # sent activations are not kept here anyway
            logger.debug("deallocate_pipeline_outputs: no effect (sent outputs are not held)")
        if fuse_microbatches and return_loss_on_cpu:
            logger.warning("return_loss_on_cpu is set to False since fuse_microbatches is True")
            return_loss_on_cpu = False  # NxD's rule; the microbatches themselves run apart
        manual = bool(manual_pp_partition)
        self.__dict__["original_torch_module"] = module  # not registered as a submodule
        self._debug_mode = bool(_debug_mode)
        if self._debug_mode:  # NxD's: partition as rank r of p, without process groups
            state, p, rank = None, _debug_pp_size, _debug_pp_rank
        else:
            state = get_parallel_state()
            p, rank = state.pipeline_parallel_size, state.pipeline_parallel_rank
        self.parallel_state = state
        self.pipeline_parallel_size, self.pipeline_parallel_rank = p, rank
        v = virtual_pipeline_size
        self.num_microbatches = num_microbatches
        self.output_loss_value_spec = output_loss_value_spec
        self.return_mb_loss = return_mb_loss
        self.broadcast_and_average_loss = broadcast_and_average_loss
        self.use_zero1_optimizer = use_zero1_optimizer
        self.use_model_wrapper = use_model_wrapper
        self.use_optimizer_wrapper = use_optimizer_wrapper
        self.return_loss_on_cpu = bool(return_loss_on_cpu)
        self.manual_pp_partition = manual
        self.manual_pp_loss_fn = manual_pp_loss_fn
        self.param_init_fn = param_init_fn
        self.virtual_pipeline_size = v
        name = schedule if schedule is not None else ("interleaved_1f1b" if v > 1 else "1f1b")
        if async_sends is None:  # unbatched crossing sends can deadlock a stream-ordered backend
            async_sends = (
                state is not None
                and torch.distributed.get_backend(state.pipeline_parallel_group) == "gloo"
            )
        self.schedule = build_schedule(name, p, num_microbatches, v, asynchronous_sends=async_sends)
        local = [s for s in range(p * v) if stage_to_rank(s, p) == rank]
        if manual:
            built = build_manual(
                list(module),  # type: ignore[arg-type]
                local,
                p,
                v,
                rank,
                partition_fn=manual_pp_stage_partition_fn,
                param_init_fn=param_init_fn,
                loss_fn=manual_pp_loss_fn,
                loss_spec=output_loss_value_spec,
                device=device,
            )
            self.transformer_layer_cls = transformer_layer_cls
        else:
            assert isinstance(module, nn.Module)
            built = build_traced(
                module,
                local,
                p,
                v,
                transformer_layer_cls=transformer_layer_cls,
                pipeline_cuts=pipeline_cuts,
                input_names=input_names,
                leaf_module_cls=leaf_module_cls,
                autowrap_functions=autowrap_functions,
                autowrap_modules=autowrap_modules,
                autowrap_obj_methods=autowrap_obj_methods,
                tracer_cls=tracer_cls,
                param_init_fn=param_init_fn,
                trace_file_path=trace_file_path,
                auto_partition=bool(auto_partition),
                device=device,
            )
            self.transformer_layer_cls = built.layer_class
        self.stages = nn.ModuleDict({str(s): stage for s, stage in built.stages.items()})
        self.input_names = built.input_names
        self.pipeline_cuts = built.pipeline_cuts
        self._fixed_inputs = built.fixed_inputs
        self._output_spec = built.output_spec
        self._built = built
        self._runner: StepRunner | None = None
        if state is not None:
            self._runner = StepRunner(
                schedule=self.schedule,
                pipeline_rank=rank,
                pipeline_ranks=state.pipeline_parallel_ranks,
                group=state.pipeline_parallel_group,
                stages=self._runtime_stages(),
                select_loss=self._loss_of,
                device=built.device,
                async_sends=async_sends,
            )
        self.timeline: Timeline | None = None
        self._reducer: GradientReducer | None = None
        self._tied_synced = False
        self._moved = False
        if not use_model_wrapper:
            self.move_model_to_device()
        logger.info(
            "NxDPPModel: pp rank %d of %d holds stages %s (%d parameters), schedule %s",
            rank,
            p,
            local,
            sum(t.numel() for _, t in self.local_named_parameters()),
            self.schedule.name,
        )

    def move_model_to_device(self) -> None:
        """NxD's: materialise this rank's meta parameters (``param_init_fn``) and move its
        stages to the device. Runs at construction, or with ``use_model_wrapper=True`` when
        the wrapper calls it (at the latest, the first ``run_train`` / ``run_eval``). Local:
        no communication. Afterwards the local parameters are final: build optimizers then."""
        if self._moved:
            return
        rebuilt = self._built.materialize()
        if rebuilt is not None:
            self.stages = nn.ModuleDict({str(s): stage for s, stage in rebuilt.items()})
        move_local_tensors(list(self.stages.values()), self._built.device)
        self._moved = True
        state = self.parallel_state
        if self._runner is None or state is None:  # _debug_mode: nothing to run or reduce
            return
        self._runner.stages = self._runtime_stages()
        named = self._all_local_names()
        for weight in self._built.tied:  # copies counted elsewhere: left out of grad norms
            if weight.name is not None and weight.first_rank != state.pipeline_parallel_rank:
                # NxD's flag nxd_layers.grads reads; torch's stub types no such attribute
                named[weight.name].shared = True  # type: ignore[attr-defined]
        self._reducer = GradientReducer(
            params=named,
            tied=self._built.tied,
            pipeline_group=state.pipeline_parallel_group,
            device=self._built.device,
        )
        self._reducer.configure(named, self._data_parallel_reduction(state))

    def _runtime_stages(self) -> dict[int, Stage]:
        """The local stages by index, as the runner calls them (each module in ``stages`` is a
        traced ``StageModule`` or a ``ManualStage``; the ModuleDict types them ``nn.Module``)."""
        return {int(s): cast(Stage, m) for s, m in self.stages.items()}

    def _groups(self) -> ParallelState:
        """The process groups (the clear error of :meth:`_step_runner` under _debug_mode)."""
        self._step_runner()
        state = self.parallel_state
        assert state is not None  # a step runner exists only with process groups
        return state

    def _data_parallel_reduction(self, state: ParallelState) -> DataParallelReduction | None:
        """How ``run_train`` averages gradients: over DP x CP (context-parallel ranks hold
        replicas too; the DP group when CP = 1), expert weights at EP > 1 summed over the
        expert-DP group and divided by DP x CP; nothing when ZeRO-1 or an optimizer wrapper
        does it (read at every call: a wrapper may set the flag later)."""
        if self.use_zero1_optimizer or self.use_optimizer_wrapper:
            return None
        replicas = state.data_parallel_size * state.context_parallel_size
        if replicas == 1:  # EP divides DP: no expert parallelism either
            return None
        group = state.data_context_parallel_group
        assert group is not None  # built with the state
        experts = state.expert_data_parallel_group if state.expert_model_parallel_size > 1 else None
        return DataParallelReduction(group=group, size=replicas, expert_group=experts)

    def _all_local_names(self) -> dict[str, nn.Parameter]:
        """Every name of every local parameter (a tied one may have several)."""
        stages = self.stages.values()
        return {n: q for s in stages for n, q in s.named_parameters(remove_duplicate=False)}

    def _prepare_step(self) -> GradientReducer:
        """Before each step: the reductions as the flags say now (parameters added since, e.g.
        adapters, included); before the first (every rank is there): NxD's sync of tied
        weight copies."""
        state = self._groups()
        self.move_model_to_device()
        assert self._reducer is not None
        self._reducer.configure(self._all_local_names(), self._data_parallel_reduction(state))
        if not self._tied_synced:
            sync_tied_weights(
                self._built.tied,
                self._all_local_names(),
                state.pipeline_parallel_rank,
                state.pipeline_parallel_group,
                self._built.device,
            )
            self._tied_synced = True
        return self._reducer

    def _step_runner(self) -> StepRunner:
        if self._runner is None:
            raise RuntimeError(
                f"this NxDPPModel was built with _debug_mode=True (NxD's partition without "
                f"process groups): it holds pipeline rank {self.pipeline_parallel_rank}'s "
                f"stages of {self.pipeline_parallel_size} to inspect and cannot run a step"
            )
        return self._runner

    def __getattr__(self, name: str) -> Any:
        """As NxD: an attribute the wrapper lacks is the original model's (``config``,
        ``generation_config``, ...)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original_torch_module")
            if isinstance(original, nn.Module) and not name.startswith("__"):
                return getattr(original, name)
            raise

    # Loss and inputs --------------------------------------------------------------------
    def _loss_of(self, output: Any) -> torch.Tensor:
        if self.manual_pp_partition:  # the last manual stage computed the loss itself
            return select_loss(output, True)
        if self._output_spec is not None:
            output = torch.utils._pytree.tree_unflatten(list(output), self._output_spec)
        return select_loss(output, self.output_loss_value_spec)

    def _split(self, kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], Hashable]:
        m = self.num_microbatches
        if self.manual_pp_partition:
            microbatches = split_manual(kwargs, m)
        else:
            microbatches = split_traced(kwargs, self.input_names, self._fixed_inputs, m)
        return microbatches, signature(microbatches[0])

    # NxD API ------------------------------------------------------------------------------
    def run_train(self, **kwargs: Any) -> torch.Tensor | list[torch.Tensor] | None:
        """Forward and backward of every microbatch under the schedule; returns the loss.

        The mean microbatch loss on the last stage (None elsewhere); ``return_mb_loss``: the
        list of microbatch losses; ``broadcast_and_average_loss``: the mean loss on every rank,
        averaged over data parallel ranks too. ``return_loss_on_cpu``: the mean on the CPU.
        Gradients are added to ``.grad`` after this call's reductions (tied weights summed
        over the pipeline, all averaged over DP unless the optimizer does it): calls
        accumulate.
        """
        self.train()
        microbatches, key = self._split(kwargs)
        reducer = self._prepare_step()
        reducer.begin()
        try:
            losses, self.timeline = self._step_runner().run(microbatches, train=True, signature=key)
        except BaseException:
            reducer.abort()
            raise
        reducer.finish()
        return self._finish_loss(losses)

    @torch.no_grad()
    def run_eval(self, **kwargs: Any) -> torch.Tensor | list[torch.Tensor] | None:
        """Forward only, under the schedule's forward order; returns the loss as run_train."""
        self.eval()
        microbatches, key = self._split(kwargs)
        self._prepare_step()
        losses, self.timeline = self._step_runner().run(microbatches, train=False, signature=key)
        return self._finish_loss(losses)

    def _finish_loss(self, losses: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor] | None:
        if self.return_mb_loss:  # as NxD: the per-microbatch losses stay where they are
            return losses if losses else None
        loss = torch.stack(losses).mean() if losses else None
        if self.broadcast_and_average_loss:
            state = self._groups()
            buffer = torch.zeros((), device=self._step_runner().device)
            if loss is not None:
                buffer.copy_(loss)
            collectives.all_reduce(buffer, group=state.pipeline_parallel_group)  # one holder
            collectives.all_reduce(buffer, group=state.data_context_parallel_group)
            loss = buffer / (state.data_parallel_size * state.context_parallel_size)
        if loss is not None and self.return_loss_on_cpu:
            loss = loss.cpu()
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "NxDPPModel runs whole pipeline steps: call run_train(**inputs) or run_eval(**inputs)"
        )
