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
from collections.abc import Hashable, Sequence
from typing import Any, cast

import torch
from torch import nn

from nxd_pipeline._build import LocalStages, build_manual, build_traced
from nxd_pipeline._checkpoint import stage_checkpoint_tensors
from nxd_pipeline._inputs import signature, split_manual, split_traced
from nxd_pipeline._local import LocalStagesMixin
from nxd_pipeline._loss import select_loss
from nxd_pipeline._materialize import move_local_tensors
from nxd_pipeline._options import PipelineOptions, nxd_signature
from nxd_pipeline._reduce import DataParallelReduction, GradientReducer, sync_tied_weights
from nxd_pipeline._runtime import Stage, StepRunner
from nxd_pipeline._schedules import build_schedule
from nxd_pipeline._timeline import Timeline
from nxd_state import ParallelState, collectives, get_parallel_state
from nxd_state.shards import CheckpointTensors, RankContext

__all__ = ["NxDPPModel"]

logger = logging.getLogger(__name__)


class NxDPPModel(LocalStagesMixin, nn.Module):
    """Pipeline-parallel wrapper with NxD's signature (see the package README).

    ``NxDPPModel(module, num_microbatches=4, ...)`` (NxD's arguments, positional in NxD's
    order) or ``NxDPPModel(module, options=PipelineOptions(num_microbatches=4, ...))``; each
    option is described on :class:`~nxd_pipeline.PipelineOptions`, whose fields the signature
    is built from. ``module`` is a model to capture and cut at ``pipeline_cuts``, or, with
    ``manual_pp_partition=True``, a list of layers (NxD's manual mode: inputs passed as
    ``run_train(inputs=..., labels=...)``).

    Construction: check the options, place this rank (its process groups, or NxD's
    ``_debug_mode`` partition without them), build the schedule, build this rank's stages,
    then the step runner; finally materialise and move the stages unless a model wrapper
    does (``use_model_wrapper``).
    """

    original_torch_module: nn.Module | Sequence[nn.Module]
    """The model (or layer list) given, as NxD keeps it; not a submodule: ``parameters()``
    and ``state_dict()`` of this wrapper hold this rank's stages only."""

    options: PipelineOptions
    """The options this model was built with (NxD's keyword arguments, mapped)."""

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        *args: Any,
        options: PipelineOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        options = _options_of(options, args, kwargs)
        options.check_module(module)
        self.__dict__["original_torch_module"] = module  # not registered as a submodule
        self.options = options
        self._set_nxd_attributes(options)
        state = self._place(options)
        async_sends = _async_sends(options.async_sends, state)
        self.schedule = build_schedule(
            options.schedule_name,
            self.pipeline_parallel_size,
            self.num_microbatches,
            self.virtual_pipeline_size,
            asynchronous_sends=async_sends,
        )
        self._set_local_stages(self._build_local_stages(module, options))
        self._runner = self._make_runner(state, async_sends)
        self.timeline: Timeline | None = None
        self._reducer: GradientReducer | None = None
        self._tied_synced = False
        self._moved = False
        if not options.use_model_wrapper:
            self.move_model_to_device()
        logger.info(
            "NxDPPModel: pp rank %d of %d holds stages %s (%d parameters), schedule %s",
            self.pipeline_parallel_rank,
            self.pipeline_parallel_size,
            [int(s) for s in self.stages],
            sum(t.numel() for _, t in self.local_named_parameters()),
            self.schedule.name,
        )

    # Construction steps ---------------------------------------------------------------------
    def _set_nxd_attributes(self, options: PipelineOptions) -> None:
        """NxD's attributes of the same names (the wrapper flags stay writable: an optimizer
        or model wrapper may set them after construction)."""
        self.num_microbatches = options.num_microbatches
        self.virtual_pipeline_size = options.virtual_pipeline_size
        self.output_loss_value_spec = options.output_loss_value_spec
        self.return_mb_loss = options.return_mb_loss
        self.broadcast_and_average_loss = options.broadcast_and_average_loss
        self.use_zero1_optimizer = options.use_zero1_optimizer
        self.use_model_wrapper = options.use_model_wrapper
        self.use_optimizer_wrapper = options.use_optimizer_wrapper
        self.manual_pp_loss_fn = options.manual_pp_loss_fn
        self.param_init_fn = options.param_init_fn
        self.manual_pp_partition = bool(options.manual_pp_partition)
        if options.deallocate_pipeline_outputs:  # sent activations are not kept here anyway
            logger.debug("deallocate_pipeline_outputs: no effect (sent outputs are not held)")
        if options.fuse_microbatches and options.return_loss_on_cpu:
            logger.warning("return_loss_on_cpu is set to False since fuse_microbatches is True")
        self.return_loss_on_cpu = options.loss_on_cpu  # the microbatches still run apart
        self._debug_mode = bool(options.debug_mode)

    def _place(self, options: PipelineOptions) -> ParallelState | None:
        """This rank's pipeline size p and rank: from the process groups, or NxD's debug mode
        (partition as rank r of p without process groups; then no state)."""
        if self._debug_mode:
            state, p, rank = None, options.debug_pp_size, options.debug_pp_rank
        else:
            state = get_parallel_state()
            p, rank = state.pipeline_parallel_size, state.pipeline_parallel_rank
        self.parallel_state = state
        self.pipeline_parallel_size, self.pipeline_parallel_rank = p, rank
        return state

    def _build_local_stages(
        self, module: nn.Module | Sequence[nn.Module], options: PipelineOptions
    ) -> LocalStages:
        """Capture and cut the model (or split the layer list) and keep this rank's stages."""
        p, rank = self.pipeline_parallel_size, self.pipeline_parallel_rank
        v = self.virtual_pipeline_size
        local = self.schedule.stages_of_rank(rank)
        if self.manual_pp_partition:
            self.transformer_layer_cls = options.transformer_layer_cls
            return build_manual(list(module), local, p, v, rank, options)  # type: ignore[arg-type]
        assert isinstance(module, nn.Module)
        built = build_traced(module, local, p, v, options)
        self.transformer_layer_cls = built.layer_class
        return built

    def _set_local_stages(self, built: LocalStages) -> None:
        """Keep the stages (as submodules) and what the steps read of the capture."""
        self.stages = nn.ModuleDict({str(s): stage for s, stage in built.stages.items()})
        self.input_names = built.input_names
        self.pipeline_cuts = built.pipeline_cuts
        self._fixed_inputs = built.fixed_inputs
        self._output_spec = built.output_spec
        self._built = built

    def _make_runner(self, state: ParallelState | None, async_sends: bool) -> StepRunner | None:
        """The runtime of this rank's action list; None without process groups (debug mode)."""
        if state is None:
            return None
        return StepRunner(
            schedule=self.schedule,
            pipeline_rank=self.pipeline_parallel_rank,
            pipeline_ranks=state.pipeline_parallel_ranks,
            group=state.pipeline_parallel_group,
            stages=self._runtime_stages(),
            select_loss=self._loss_of,
            device=self._built.device,
            async_sends=async_sends,
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

    def checkpoint_tensors(self, ctx: RankContext, *, for_load: bool = False) -> CheckpointTensors:
        """The checkpoint protocol (:mod:`nxd_state.shards`): this rank's stages' tensors under
        the original names (:mod:`nxd_pipeline._checkpoint`)."""
        return stage_checkpoint_tensors(self.stages.values(), ctx)

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


setattr(  # noqa: B010 - inspect reads NxD's signature, built from PipelineOptions' fields
    NxDPPModel.__init__,
    "__signature__",
    nxd_signature(leading=("self", "module"), trailing=("options",)),
)


def _options_of(
    options: PipelineOptions | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> PipelineOptions:
    """``options``, or NxD's arguments mapped onto them; both at once is an error."""
    if options is None:
        return PipelineOptions.from_nxd(*args, **kwargs)
    if not isinstance(options, PipelineOptions):
        raise TypeError(f"options must be a PipelineOptions, got {type(options).__name__}")
    if args or kwargs:
        given = [f"{len(args)} positional argument(s)"] if args else []
        raise TypeError(
            f"NxDPPModel takes options=PipelineOptions(...) or NxD's arguments, not both: got "
            f"options and {', '.join(given + sorted(kwargs))}"
        )
    return options


def _async_sends(requested: bool | None, state: ParallelState | None) -> bool:
    """Non-blocking p2p as requested; by default on for gloo only (unbatched crossing sends
    can deadlock a stream-ordered backend)."""
    if requested is not None:
        return requested
    if state is None:
        return False
    return torch.distributed.get_backend(state.pipeline_parallel_group) == "gloo"
