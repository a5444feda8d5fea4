"""NxDPPModel: NxD's pipeline-parallel model wrapper.

``NxDPPModel(module, ...)`` captures the model's graph, cuts it into ``p·v`` stages, keeps only
this rank's stages (materialising their parameters if the model was built on the meta device),
and runs a schedule in ``run_train`` / ``run_eval``. After a training step the gradients of
parameters shared by several stages (tied embeddings) are summed over the pipeline group and,
unless ZeRO-1 takes over, averaged over the data-parallel group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn

from nxd_pipeline._materialize import materialize_local_parameters
from nxd_pipeline._partition import auto_pipeline_cuts, build_stage_module, partition_graph
from nxd_pipeline._runtime import StepRunner
from nxd_pipeline._schedules import build_schedule, stage_to_rank
from nxd_pipeline._timeline import Timeline
from nxd_pipeline._trace import capture_graph
from nxd_state import collectives, get_parallel_state

__all__ = ["NxDPPModel"]

logger = logging.getLogger(__name__)


def _select_loss(output: Any, spec: tuple[bool, ...] | dict[str, bool] | None) -> torch.Tensor:
    """The loss in ``output`` per NxD's ``output_loss_value_spec``."""
    if spec is None:
        if isinstance(output, torch.Tensor):
            loss = output
        elif hasattr(output, "keys") and "loss" in output:
            loss = output["loss"]
        elif isinstance(output, (tuple, list)):
            loss = output[0]
        else:
            raise TypeError(
                f"cannot find the loss in a {type(output).__name__} output: pass "
                f"output_loss_value_spec, e.g. (True, False) or {{'loss': True}}"
            )
    elif isinstance(spec, dict):
        keys = [k for k, flag in spec.items() if flag]
        if len(keys) != 1:
            raise ValueError(f"output_loss_value_spec {spec} must mark exactly one key True")
        loss = output[keys[0]]
    else:
        index = [i for i, flag in enumerate(spec) if flag]
        if len(index) != 1:
            raise ValueError(f"output_loss_value_spec {spec} must mark exactly one entry True")
        loss = output[index[0]]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the selected loss must be a scalar tensor, got {loss!r:.80}")
    return loss


class NxDPPModel(nn.Module):
    """Pipeline-parallel wrapper with NxD's signature (see the package README).

    Beyond NxD's arguments: ``virtual_pipeline_size`` (model chunks per rank, interleaving),
    ``schedule`` (``"1f1b"`` default, ``"gpipe"``, ``"interleaved_1f1b"`` (default when
    v > 1), ``"zb_h1"``), ``device`` (where local stages live; default: where the
    model's parameters are, or CPU for a meta model) and ``async_sends`` (non-blocking p2p:
    sends left in flight, receives waited for only where their data is used, instead of
    synchronous batches; default: on for gloo only).
    """

    def __init__(
        self,
        module: nn.Module,
        transformer_layer_cls: type | None = None,
        num_microbatches: int = 1,
        output_loss_value_spec: dict[str, bool] | tuple[bool, ...] | None = None,
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
        *,
        virtual_pipeline_size: int = 1,
        schedule: str | None = None,
        device: torch.device | str | None = None,
        async_sends: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if return_mb_loss and broadcast_and_average_loss:
            raise ValueError(
                "return_mb_loss=True and broadcast_and_average_loss=True are exclusive: "
                "broadcast_and_average_loss requires return_mb_loss=False"
            )
        if auto_partition and pipeline_cuts:
            raise ValueError(
                f"auto_partition=True chooses the cuts itself; got pipeline_cuts={pipeline_cuts}"
            )
        state = get_parallel_state()
        self.parallel_state = state
        p, v = state.pipeline_parallel_size, virtual_pipeline_size
        num_stages = p * v
        self.num_microbatches = num_microbatches
        self.output_loss_value_spec = output_loss_value_spec
        self.return_mb_loss = return_mb_loss
        self.broadcast_and_average_loss = broadcast_and_average_loss
        self.use_zero1_optimizer = use_zero1_optimizer
        self.virtual_pipeline_size = v
        name = schedule if schedule is not None else ("interleaved_1f1b" if v > 1 else "1f1b")
        if async_sends is None:  # unbatched crossing sends can deadlock a stream-ordered backend
            backend = torch.distributed.get_backend(state.pipeline_parallel_group)
            async_sends = backend == "gloo"
        self.schedule = build_schedule(name, p, num_microbatches, v, asynchronous_sends=async_sends)
        if transformer_layer_cls is None and tracer_cls == "hf":
            transformer_layer_cls = _hf_layer_class(module)
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
        rank = state.pipeline_parallel_rank
        local = [s for s in range(num_stages) if stage_to_rank(s, p) == rank]
        target = torch.device(device) if device is not None else _model_device(module)
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
        # Tied weights held by several pipeline ranks: (local name or None, shape, dtype).
        self._shared: list[tuple[str | None, tuple[int, ...], torch.dtype]] = []
        for group in plan.shared_parameters():
            if len({stage_to_rank(s, p) for s in group}) > 1:
                first = plan.stage_parameters[min(group)][group[min(group)]]
                mine = next((group[s] for s in local if s in group), None)
                self._shared.append((mine, tuple(first.shape), first.dtype))
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

    # Loss and inputs --------------------------------------------------------------------
    def _loss_of(self, output: Any) -> torch.Tensor:
        if self._output_spec is not None:
            output = torch.utils._pytree.tree_unflatten(list(output), self._output_spec)
        return _select_loss(output, self.output_loss_value_spec)

    def _split(self, kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], Hashable]:
        missing = [n for n in self.input_names if n not in kwargs]
        unknown = [n for n in kwargs if n not in self.input_names]
        if missing or unknown:
            raise ValueError(
                f"run_train/run_eval take the traced inputs {self.input_names}; missing "
                f"{missing}, unexpected {unknown}"
            )
        m = self.num_microbatches
        chunks: dict[str, list[Any]] = {}
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                if value.dim() == 0 or value.shape[0] % m != 0:
                    raise ValueError(
                        f"input {name!r} of shape {tuple(value.shape)}: batch size must be "
                        f"divisible by num_microbatches={m}"
                    )
                chunks[name] = list(value.chunk(m, dim=0))
            else:
                chunks[name] = [value] * m
        microbatches = [
            {**self._fixed_inputs, **{n: chunks[n][i] for n in chunks}} for i in range(m)
        ]
        signature = tuple(
            (n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, repr(v))
            for n, v in sorted(microbatches[0].items())
        )
        return microbatches, signature

    # NxD API ------------------------------------------------------------------------------
    def run_train(self, **kwargs: Any) -> torch.Tensor | list[torch.Tensor] | None:
        """Forward and backward of every microbatch under the schedule; returns the loss.

        The mean microbatch loss on the last stage (None elsewhere); ``return_mb_loss``: the
        list of microbatch losses; ``broadcast_and_average_loss``: the mean loss on every rank,
        averaged over data parallel ranks too.
        """
        self.train()
        microbatches, signature = self._split(kwargs)
        losses, self.timeline = self._runner.run(microbatches, train=True, signature=signature)
        self._reduce_gradients()
        return self._finish_loss(losses)

    @torch.no_grad()
    def run_eval(self, **kwargs: Any) -> torch.Tensor | list[torch.Tensor] | None:
        """Forward only, under the schedule's forward order; returns the loss as run_train."""
        self.eval()
        microbatches, signature = self._split(kwargs)
        losses, self.timeline = self._runner.run(microbatches, train=False, signature=signature)
        return self._finish_loss(losses)

    def _finish_loss(self, losses: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor] | None:
        state = self.parallel_state
        if self.return_mb_loss:
            return losses if losses else None
        loss = torch.stack(losses).mean() if losses else None
        if not self.broadcast_and_average_loss:
            return loss
        buffer = torch.zeros((), device=self._runner.device)
        if loss is not None:
            buffer.copy_(loss)
        collectives.all_reduce(buffer, group=state.pipeline_parallel_group)  # one holder
        collectives.all_reduce(buffer, group=state.data_parallel_group)
        return buffer / state.data_parallel_size

    def _reduce_gradients(self) -> None:
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


def _model_device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    if param is None or param.device.type == "meta":
        return torch.device("cpu")
    return param.device


def _hf_layer_class(module: nn.Module) -> type | None:
    """Hugging Face models name their layer class in ``_no_split_modules``."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in names:
            return type(sub)
    return None
