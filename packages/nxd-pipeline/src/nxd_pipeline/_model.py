"""NxDPPModel: NxD's pipeline-parallel wrapper.

``NxDPPModel(module, ...)`` captures the model's graph, cuts it into ``p·v`` stages, keeps only
this rank's stages (materialising their parameters if the model was built on the meta device),
and runs a schedule in ``run_train`` / ``run_eval``. With ``manual_pp_partition=True`` the model
is a list of layers instead, split into stages without any capture (:mod:`nxd_pipeline._manual`).
After a training step the gradients of parameters shared by several pipeline ranks (tied
embeddings) are summed over the pipeline group and, unless ZeRO-1 takes over, averaged over the
data-parallel group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn

from nxd_pipeline._arguments import check_arguments
from nxd_pipeline._inputs import signature, split_manual, split_traced
from nxd_pipeline._loss import LossSpec, select_loss
from nxd_pipeline._manual import assign_stages, build_manual_stages
from nxd_pipeline._materialize import materialize_local_parameters, model_device
from nxd_pipeline._partition import auto_pipeline_cuts, build_stage_module, partition_graph
from nxd_pipeline._runtime import StepRunner
from nxd_pipeline._schedules import build_schedule, stage_to_rank
from nxd_pipeline._shared import shared_weights, sync_shared_weights
from nxd_pipeline._timeline import Timeline
from nxd_pipeline._trace import capture_graph, hf_layer_class
from nxd_state import collectives, get_parallel_state

__all__ = ["NxDPPModel"]

logger = logging.getLogger(__name__)

PartitionFn = Callable[[Sequence[nn.Module], int], dict[nn.Module, int]]


class NxDPPModel(nn.Module):
    """Pipeline-parallel wrapper with NxD's signature (see the package README).

    ``module`` is a model to capture and cut at ``pipeline_cuts``, or, with
    ``manual_pp_partition=True``, a list of layers (NxD's manual mode: stages from
    ``manual_pp_stage_partition_fn``, loss from ``manual_pp_loss_fn``, inputs passed as
    ``run_train(inputs=..., labels=...)``). ``return_loss_on_cpu`` (NxD's default True) returns
    the loss on the CPU.

    Beyond NxD's arguments: ``virtual_pipeline_size`` (model chunks per rank, interleaving),
    ``schedule`` (``"1f1b"`` default, ``"gpipe"``, ``"interleaved_1f1b"`` (default when
    v > 1), ``"zb_h1"``), ``device`` (where local stages live; default: where the
    model's parameters are, or CPU for a meta model) and ``async_sends`` (non-blocking p2p:
    sends left in flight, receives waited for only where their data is used, instead of
    synchronous batches; default: on for gloo only). NxD's XLA runtime knobs
    (``_all_reduce_send_recv``, ``fuse_microbatches``...) are
    accepted and have no effect.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        transformer_layer_cls: type | None = None,
        num_microbatches: int = 1,
        output_loss_value_spec: LossSpec = None,
        return_mb_loss: bool = False,
        broadcast_and_average_loss: bool = False,
        pipeline_cuts: list[str] | None = None,
        input_names: list[str] | None = None,
        leaf_module_cls: list[type] | None = None,
        autowrap_functions: tuple[Callable[..., Any], ...] | None = None,
        autowrap_modules: tuple[ModuleType, ...] | None = None,
        tracer_cls: str | type[fx.Tracer] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        trace_file_path: str | None = None,
        use_zero1_optimizer: bool = False,
        auto_partition: bool | None = False,
        return_loss_on_cpu: bool | None = True,
        manual_pp_partition: bool | None = False,
        manual_pp_stage_partition_fn: PartitionFn | None = None,
        manual_pp_loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        virtual_pipeline_size: int = 1,
        schedule: str | None = None,
        device: torch.device | str | None = None,
        async_sends: bool | None = None,
        **xla_runtime_options: Any,
    ) -> None:
        super().__init__()
        check_arguments(
            module,
            num_microbatches=num_microbatches,
            return_mb_loss=return_mb_loss,
            broadcast_and_average_loss=broadcast_and_average_loss,
            pipeline_cuts=pipeline_cuts,
            auto_partition=bool(auto_partition),
            output_loss_value_spec=output_loss_value_spec,
            manual_pp_partition=bool(manual_pp_partition),
            manual_options=(manual_pp_loss_fn, manual_pp_stage_partition_fn),
            xla_runtime_options=xla_runtime_options,
        )
        manual = bool(manual_pp_partition)
        state = get_parallel_state()
        self.parallel_state = state
        p, v = state.pipeline_parallel_size, virtual_pipeline_size
        self.num_microbatches = num_microbatches
        self.output_loss_value_spec = output_loss_value_spec
        self.return_mb_loss = return_mb_loss
        self.broadcast_and_average_loss = broadcast_and_average_loss
        self.use_zero1_optimizer = use_zero1_optimizer
        self.return_loss_on_cpu = bool(return_loss_on_cpu)
        self.manual_pp_partition = manual
        self.manual_pp_loss_fn = manual_pp_loss_fn
        self.virtual_pipeline_size = v
        name = schedule if schedule is not None else ("interleaved_1f1b" if v > 1 else "1f1b")
        if async_sends is None:  # unbatched crossing sends can deadlock a stream-ordered backend
            backend = torch.distributed.get_backend(state.pipeline_parallel_group)
            async_sends = backend == "gloo"
        self.schedule = build_schedule(name, p, num_microbatches, v, asynchronous_sends=async_sends)
        rank = state.pipeline_parallel_rank
        local = [s for s in range(p * v) if stage_to_rank(s, p) == rank]
        # Tied weights held by several pipeline ranks: (local name or None, shape, dtype).
        self._shared: list[tuple[str | None, tuple[int, ...], torch.dtype]] = []
        self.input_names: list[str] = []
        self._fixed_inputs: dict[str, Any] = {}
        self._output_spec: Any = None
        self.pipeline_cuts: list[str] = []
        if manual:
            target = self._build_manual(
                list(module),  # type: ignore[arg-type]
                local,
                manual_pp_stage_partition_fn,
                param_init_fn,
                device,
            )
        else:
            assert isinstance(module, nn.Module)
            target = self._build_traced(
                module,
                local,
                transformer_layer_cls=transformer_layer_cls,
                pipeline_cuts=pipeline_cuts,
                input_names=input_names,
                leaf_module_cls=leaf_module_cls,
                autowrap_functions=autowrap_functions,
                autowrap_modules=autowrap_modules,
                tracer_cls=tracer_cls,
                param_init_fn=param_init_fn,
                trace_file_path=trace_file_path,
                auto_partition=bool(auto_partition),
                device=device,
            )
        self._runner = StepRunner(
            schedule=self.schedule,
            pipeline_rank=rank,
            pipeline_ranks=state.pipeline_parallel_ranks,
            group=state.pipeline_parallel_group,
            stages={int(s): m for s, m in self.stages.items()},
            select_loss=self._loss_of,
            device=target,
            async_sends=async_sends,
        )
        self.timeline: Timeline | None = None
        logger.info(
            "NxDPPModel: pp rank %d of %d holds stages %s (%d parameters), schedule %s",
            rank,
            p,
            local,
            sum(t.numel() for _, t in self.local_named_parameters()),
            self.schedule.name,
        )

    # Building the local stages -----------------------------------------------------------
    def _build_traced(
        self,
        module: nn.Module,
        local: list[int],
        *,
        transformer_layer_cls: type | None,
        pipeline_cuts: list[str] | None,
        input_names: list[str] | None,
        leaf_module_cls: list[type] | None,
        autowrap_functions: tuple[Callable[..., Any], ...] | None,
        autowrap_modules: tuple[ModuleType, ...] | None,
        tracer_cls: str | type[fx.Tracer] | None,
        param_init_fn: Callable[[nn.Module], None] | None,
        trace_file_path: str | None,
        auto_partition: bool,
        device: torch.device | str | None,
    ) -> torch.device:
        """Capture, cut and keep the local stages; returns the device they run on."""
        p, v = self.parallel_state.pipeline_parallel_size, self.virtual_pipeline_size
        num_stages = p * v
        if transformer_layer_cls is None and tracer_cls == "hf":
            transformer_layer_cls = hf_layer_class(module)
        leaves = list(leaf_module_cls or [])
        if transformer_layer_cls is not None:
            leaves.append(transformer_layer_cls)
        captured = capture_graph(
            module,
            tracer_cls=tracer_cls,
            input_names=input_names,
            leaf_module_cls=tuple(leaves),
            autowrap_modules=tuple(autowrap_modules or ()),
            autowrap_functions=tuple(autowrap_functions or ()),
        )
        if trace_file_path is not None:
            with open(trace_file_path, "w") as handle:
                handle.write(str(captured.graph_module.graph))
        if num_stages > 1 and not pipeline_cuts:
            if not auto_partition:
                raise ValueError(
                    f"pipeline size {p} x virtual pipeline size {v} = {num_stages} stages need "
                    f"{num_stages - 1} pipeline_cuts (layer names), or auto_partition=True"
                )
            if transformer_layer_cls is None:
                raise ValueError("auto_partition=True needs transformer_layer_cls")
            layers = [n for n, m in module.named_modules() if isinstance(m, transformer_layer_cls)]
            pipeline_cuts = auto_pipeline_cuts(captured, module, layers, num_stages)
        self.pipeline_cuts = list(pipeline_cuts or [])
        plan = partition_graph(captured, module, self.pipeline_cuts, num_stages)
        self.input_names = captured.input_names
        self._fixed_inputs = captured.fixed_inputs
        self._output_spec = captured.output_spec
        target = torch.device(device) if device is not None else model_device(module)
        materialize_local_parameters(
            module,
            [plan.stage_parameters[s] for s in local],
            target,
            param_init_fn,
            [plan.stage_buffers[s] for s in local],
        )
        self.stages = nn.ModuleDict(
            {str(s): build_stage_module(plan, module, s, target) for s in local}
        )
        for group in plan.shared_parameters():
            if len({stage_to_rank(s, p) for s in group}) > 1:
                first = plan.stage_parameters[min(group)][group[min(group)]]
                mine = next((group[s] for s in local if s in group), None)
                self._shared.append((mine, tuple(first.shape), first.dtype))
        return target

    def _build_manual(
        self,
        layers: list[nn.Module],
        local: list[int],
        partition_fn: PartitionFn | None,
        param_init_fn: Callable[[nn.Module], None] | None,
        device: torch.device | str | None,
    ) -> torch.device:
        """NxD's manual mode: stages from the layer list; returns the device they run on."""
        state = self.parallel_state
        p, rank = state.pipeline_parallel_size, state.pipeline_parallel_rank
        stage_of = assign_stages(layers, p * self.virtual_pipeline_size, partition_fn)
        self.input_names = ["inputs", "labels"]
        target = torch.device(device) if device is not None else model_device(*layers)
        stages = build_manual_stages(
            layers,
            stage_of,
            local,
            target,
            param_init_fn,
            self.manual_pp_loss_fn,
            self.output_loss_value_spec,
        )
        self.stages = nn.ModuleDict({str(s): stage for s, stage in stages.items()})
        shared = shared_weights(layers, stage_of, p, rank)  # after materialising: final objects
        sync_shared_weights(shared, p, rank, state.pipeline_parallel_group, target)
        names = {id(param): name for name, param in self.local_named_parameters()}
        for weight in shared:
            local_name = names[id(weight.local)] if weight.local is not None else None
            self._shared.append((local_name, weight.shape, weight.dtype))
        logger.info(
            "manual partition: layers per stage %s; weights shared across pipeline ranks: %s",
            [stage_of.count(s) for s in range(max(stage_of) + 1)],
            [weight.group for weight in shared],
        )
        return target

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
        """
        self.train()
        microbatches, key = self._split(kwargs)
        losses, self.timeline = self._runner.run(microbatches, train=True, signature=key)
        self._reduce_gradients()
        return self._finish_loss(losses)

    @torch.no_grad()
    def run_eval(self, **kwargs: Any) -> torch.Tensor | list[torch.Tensor] | None:
        """Forward only, under the schedule's forward order; returns the loss as run_train."""
        self.eval()
        microbatches, key = self._split(kwargs)
        losses, self.timeline = self._runner.run(microbatches, train=False, signature=key)
        return self._finish_loss(losses)

    def _finish_loss(self, losses: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor] | None:
        state = self.parallel_state
        if self.return_mb_loss:  # as NxD: the per-microbatch losses stay where they are
            return losses if losses else None
        loss = torch.stack(losses).mean() if losses else None
        if self.broadcast_and_average_loss:
            buffer = torch.zeros((), device=self._runner.device)
            if loss is not None:
                buffer.copy_(loss)
            collectives.all_reduce(buffer, group=state.pipeline_parallel_group)  # one holder
            collectives.all_reduce(buffer, group=state.data_parallel_group)
            loss = buffer / state.data_parallel_size
        if loss is not None and self.return_loss_on_cpu:
            loss = loss.cpu()
        return loss

    def _reduce_gradients(self) -> None:
        """Sum the gradients of weights shared across pipeline ranks; average over DP.

        The DP average is skipped with ``use_zero1_optimizer=True`` (the optimizer reduces).
        """
        state = self.parallel_state
        local = dict(self.local_named_parameters())
        for name, shape, dtype in self._shared:  # tied weights: sum the stages' contributions
            param = local.get(name) if name is not None else None
            grad = torch.zeros(shape, dtype=dtype, device=self._runner.device)
            if param is not None and param.grad is not None:
                grad.copy_(param.grad)
            collectives.all_reduce(grad, group=state.pipeline_parallel_group)
            if param is not None:
                param.grad = grad
        if self.use_zero1_optimizer or state.data_parallel_size == 1:
            return
        grads = [p.grad for _, p in self.local_named_parameters() if p.grad is not None]
        collectives.all_reduce_bucketed(grads, state.data_parallel_group, average=True)

    def local_named_parameters(
        self, *args: Any, **kwargs: Any
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, param in stage.named_parameters(remove_duplicate=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def local_parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.local_named_parameters():
            yield param

    def local_named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        """This rank's stage modules' submodules under the original model's names."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, module in stage.named_modules():
                if name and id(module) not in seen:
                    seen.add(id(module))
                    yield name, module

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of the local stages under the original names."""
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages.values():
            for name, tensor in stage.state_dict(keep_vars=False).items():
                out.setdefault(name, tensor)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "NxDPPModel runs whole pipeline steps: call run_train(**inputs) or run_eval(**inputs)"
        )
