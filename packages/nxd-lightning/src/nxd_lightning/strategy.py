"""The NxD strategy: Lightning's processes on nxd's ``[PP, DP, TP]`` layout.

``world = TP x PP x DP`` ranks; with expert parallelism the experts of each MoE layer are split
over EP consecutive DP ranks (EP divides DP; expert DP = DP / EP). The strategy

1. checks when it is built that the sizes are ones the trainer API runs (``nxd_config`` read
   by ``NxDConfig``: EP > 1 needs PP = 1, CP = 1 and no LoRA, refused with the trainer's
   message), and when the Trainer is built that ``TP x PP`` divides Lightning's world size and
   EP the DP size (one error, on every rank, before any process exists or communicates);
2. creates the process group through ``nxd_state.init_distributed`` (gloo on CPU, NCCL on CUDA,
   ``xla`` on XLA devices), or takes the one that exists (``torchrun`` scripts, tests);
3. builds the TP/PP/DP (and EP) groups with ``nxd_state.initialize_model_parallel`` from
   ``nxd_config`` (or the sizes), unless they exist with the same sizes; at EP > 1 the
   module's ``initialize_parallel_model`` shards the experts and its nxd optimizer averages
   expert gradients over the expert-DP group (ZeRO-1: ``NeuronEPZero1Optimizer``);
4. gives Lightning's ``DistributedSampler`` the data-parallel rank and size, not the world's:
   the TP and PP ranks of one replica read the same samples;
5. leaves the model alone (``NeuronLTModule.setup`` builds it in place through
   ``initialize_parallel_model``; no DDP wrapper: the optimizer wrapper reduces gradients over
   DP once per step) and saves / loads checkpoints through :class:`NeuronCheckpointIO`
   (nxd-ckpt's sharded safetensors, Lightning's loop state as JSON), on every rank;
6. gives a plain ``LightningModule`` what DDP would (:mod:`nxd_lightning._plain`): the start
   from DP rank 0, the DP gradient mean each step, clipping over the whole model at TP > 1,
   and a clear refusal of the TP / PP / EP degrees it cannot honour.

:class:`NxDStrategy` runs on CPU, CUDA and XLA devices; :class:`NeuronXLAStrategy` is NxD's name
and signature for the same strategy.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

import nxd_state
from nxd_lightning._comm import all_gather_stacked, broadcast_object, reduce_tensor
from nxd_lightning._launch import ShardedMultiProcessingLauncher
from nxd_lightning._mixing import check_no_pytorch_lightning, trainer_init_arguments
from nxd_lightning._plain import (
    average_gradients_over_dp,
    broadcast_from_dp_rank0,
    check_plain_module,
    clip_grad_norm_full,
)
from nxd_lightning.checkpoint_io import LOADED_KEY, NeuronCheckpointIO

__all__ = ["NeuronXLAStrategy", "NxDStrategy"]

logger = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
_START_METHODS = get_args(StartMethod)


def _sizes(
    nxd_config: Any,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    expert_parallel_size: int,
) -> tuple:
    """(config dict or None, TP, PP, EP), read through nxd-trainer's validation (the config's
    every rule), and what Lightning does not run yet refused: EP > 1 with PP > 1 (the trainer
    API and nxd-train run it; this strategy's tests do not), CP > 1."""
    given = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "expert_parallel_size": expert_parallel_size,
    }
    for name, value in given.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if nxd_config is None:
        _refuse_expert_with_pipeline(expert_parallel_size, pipeline_parallel_size)
        return None, tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
    from nxd_trainer import NxDConfig

    config = NxDConfig.from_nxd(nxd_config)
    for name, value in given.items():
        if value != 1 and value != getattr(config, name):
            raise ValueError(
                f"{name}={value} contradicts nxd_config[{name!r}]={getattr(config, name)}: "
                f"give the sizes in nxd_config only"
            )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"nxd_config has context_parallel_size={config.context_parallel_size}: NxDStrategy "
            f"has no context parallelism yet (its groups and sampler are [PP, DP, TP]); expected "
            f"context_parallel_size=1 (the trainer API and nxd-train --cp run it)"
        )
    _refuse_expert_with_pipeline(config.expert_parallel_size, config.pipeline_parallel_size)
    sizes = (config.tensor_parallel_size, config.pipeline_parallel_size)
    return config.to_nxd(), *sizes, config.expert_parallel_size


def _refuse_expert_with_pipeline(ep: int, pp: int) -> None:
    if ep > 1 and pp > 1:
        raise ValueError(
            f"expert_parallel_size={ep} with pipeline_parallel_size={pp} is not supported by "
            f"NxDStrategy yet: Lightning runs expert parallelism at pipeline_parallel_size=1 "
            f"(the trainer API and nxd-train --ep --pp run both)"
        )


def _clip_over_the_whole_model(plugin: Any) -> None:
    """Make ``plugin``'s clipping by norm use the whole model's norm (over TP), not this
    rank's shards' (Lightning's ``clip_grad_by_norm`` is torch's, local)."""

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        clip_grad_norm_full(plugin.main_params(optimizer), float(clip_val))

    plugin.clip_grad_by_norm = clip_grad_by_norm


class NxDStrategy(ParallelStrategy):
    """Lightning strategy for NxD's tensor, pipeline, expert and data parallelism (module
    docstring).

    ``nxd_config``: the config of ``neuronx_distributed_config`` (or an ``nxd_trainer.NxDConfig``,
    which builds no process group: use it before Lightning's launcher starts the processes);
    without it, ``tensor_parallel_size``, ``pipeline_parallel_size`` and
    ``expert_parallel_size`` (a size given besides the config must equal the config's).
    ``save_load_xser`` is passed to :class:`NeuronCheckpointIO` (accepted; the format writes
    tensor by tensor).
    Keyword-only (nxd): ``start_method`` for Lightning's launcher (``"popen"`` re-runs the
    script per device, as Lightning's ``"ddp"``; ``"spawn"``/``"fork"``/``"forkserver"``), the
    process group ``timeout``, ``checkpoint_io`` and ``cluster_environment``.
    """

    def __init__(
        self,
        nxd_config: dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        save_load_xser: bool = True,
        *,
        expert_parallel_size: int = 1,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_io: NeuronCheckpointIO | None = None,
        cluster_environment: Any = None,
        debug: bool = False,
        sync_module_states: bool = False,
    ) -> None:
        config, tp, pp, ep = _sizes(
            nxd_config, tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
        )
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
        if checkpoint_io is None:
            checkpoint_io = NeuronCheckpointIO(save_load_xser=save_load_xser)
        elif not isinstance(checkpoint_io, NeuronCheckpointIO):
            raise TypeError(
                f"checkpoint_io must be a NeuronCheckpointIO (sharded nxd checkpoints), got "
                f"{type(checkpoint_io).__qualname__}"
            )
        accelerator = None
        if nxd_state.resolve_device_type() == "xla":
            from nxd_lightning._xla import NxDXLAAccelerator

            accelerator = NxDXLAAccelerator()
        super().__init__(
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            cluster_environment=cluster_environment,
        )
        self.nxd_config = config
        self.tensor_parallel_size = tp
        self.pipeline_parallel_size = pp
        self.expert_parallel_size = ep
        self.save_load_xser = save_load_xser
        self.debug = debug
        self.sync_module_states = sync_module_states
        self._start_method = start_method
        self._timeout = timeout
        self._num_nodes = 1
        self._layout: nxd_state.ParallelLayout | None = None

    # Ranks and sizes ----------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always: Lightning then adds a DistributedSampler (over DP, see below)."""
        return True

    @property
    def layout(self) -> nxd_state.ParallelLayout:
        """The ``[PP, DP, TP]`` layout of this job (known once the world size is)."""
        if self._layout is None:
            self.set_world_ranks()
        assert self._layout is not None
        return self._layout

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.global_rank).dp

    @property
    def tensor_parallel_rank(self) -> int:
        return self.layout.coordinates(self.global_rank).tp

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.layout.coordinates(self.global_rank).pp

    @property
    def expert_parallel_rank(self) -> int:
        """This rank's place in its EP group (EP consecutive DP ranks): ``dp_rank mod EP``."""
        return self.data_parallel_rank % self.expert_parallel_size

    def set_world_ranks(self) -> None:
        """Lightning's rank arithmetic (as DDP), then the layout: TP x PP must divide the world
        (checked when the Trainer is built, before any process starts)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # lightning_utilities reads `rank` off the function; its type does not declare it.
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._layout = nxd_state.ParallelLayout(
            world_size=self.world_size,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            expert_model_parallel_size=self.expert_parallel_size,
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Samples are split over data-parallel replicas: rank and size in the DP group."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        device = devices[self.local_rank] if devices else torch.device("cpu")
        if device.type == "xla":
            return nxd_state.current_device("xla")
        return device

    # Launch and process groups ---------------------------------------------------------------
    def _configure_launcher(self) -> None:
        arguments = trainer_init_arguments()
        if arguments is not None:
            check_no_pytorch_lightning(arguments)
        assert self.cluster_environment is not None
        external = self.cluster_environment.creates_processes_externally
        if self._start_method == "popen" or external:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = ShardedMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None:
            check_no_pytorch_lightning(
                {
                    # Lightning's connectors set these two on the Trainer; its class does not
                    # declare them.
                    "callbacks": list(trainer.callbacks),  # type: ignore[attr-defined]
                    "loggers": list(trainer.loggers),
                    "datamodule": trainer.datamodule,  # type: ignore[attr-defined]
                    "precision plugin": trainer.precision_plugin,
                }
            )
        self.setup_distributed()
        super().setup_environment()

    def setup_distributed(self) -> None:
        """The process group (created here, or the existing one checked), then the TP/PP/DP
        groups."""
        reset_seed()
        self.set_world_ranks()
        if dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (self.world_size, self.global_rank):
                raise RuntimeError(
                    f"a process group exists with world size {dist.get_world_size()} (this is "
                    f"rank {dist.get_rank()}), but the Trainer runs {self.world_size} processes "
                    f"and this one is rank {self.global_rank}. A group made before Lightning "
                    f"starts its processes cannot be used: let the strategy create it (build "
                    f"the config with neuronx_distributed_config or NxDConfig, which create "
                    f"none outside a launcher), or launch with torchrun"
                )
        else:
            self._init_process_group()
        sizes = (self.tensor_parallel_size, self.pipeline_parallel_size, self.expert_parallel_size)
        if nxd_state.model_parallel_is_initialized():
            state = nxd_state.get_parallel_state()
            have = (
                state.tensor_parallel_size,
                state.pipeline_parallel_size,
                state.expert_model_parallel_size,
            )
            if have != sizes:
                raise RuntimeError(
                    f"model parallelism is initialised with tensor_parallel_size={have[0]}, "
                    f"pipeline_parallel_size={have[1]}, expert_parallel_size={have[2]}, but the "
                    f"strategy was given {sizes[0]}, {sizes[1]} and {sizes[2]}"
                )
        else:
            nxd_state.initialize_model_parallel(
                tensor_model_parallel_size=sizes[0],
                pipeline_model_parallel_size=sizes[1],
                expert_model_parallel_size=sizes[2],
            )
        logger.info(
            "NxD strategy: rank %d of %d, TP=%d PP=%d EP=%d DP=%d (tp %d, pp %d, dp %d)",
            self.global_rank,
            self.world_size,
            *sizes,
            self.data_parallel_size,
            self.tensor_parallel_rank,
            self.pipeline_parallel_rank,
            self.data_parallel_rank,
        )

    def _init_process_group(self) -> None:
        """torchrun's environment from Lightning's cluster environment, then nxd_state."""
        env = self.cluster_environment
        assert env is not None
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["RANK"] = str(self.global_rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(self.num_processes))
        nxd_state.init_distributed(device_type=self.root_device.type, timeout=self._timeout)

    # The model: built by the module, never wrapped ----------------------------------------------
    def connect(self, model: Any) -> None:
        """Lightning's connection; a ``NeuronLTModule`` first takes the Trainer's
        ``gradient_clip_val`` and ``accumulate_grad_batches`` (its optimizer clips and its
        steps accumulate: :meth:`NeuronLTModule.adopt_trainer_settings`)."""
        trainer = getattr(model, "_trainer", None)
        if _is_nxd_module(model) and trainer is not None:
            model.adopt_trainer_settings(trainer)
        super().connect(model)

    @property
    def is_plain_module(self) -> bool:
        """Whether the module is a plain ``LightningModule`` (not a ``NeuronLTModule``, whose
        nxd optimizer averages gradients over DP itself): the strategy then does what DDP
        does (:mod:`nxd_lightning._plain`)."""
        module = self.lightning_module
        return module is not None and not _is_nxd_module(module)

    def model_to_device(self) -> None:
        """A plain module is moved to this rank's device; a ``NeuronLTModule``'s model is
        already there (``initialize_parallel_model`` put each rank's part on its device)."""
        if self.is_plain_module:
            assert self.model is not None
            self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        """A plain module: refused at TP / PP degrees it cannot honour, then its replicas made
        equal (DP rank 0's parameters and buffers, as DDP), and clipping by norm over the
        whole model at TP > 1."""
        if self.is_plain_module:
            module = self.lightning_module
            assert module is not None
            check_plain_module(module, self.tensor_parallel_size, self.pipeline_parallel_size)
        super().setup(trainer)
        if self.is_plain_module:
            assert self.model is not None
            broadcast_from_dp_rank0(self.model)
            if self.tensor_parallel_size > 1:
                _clip_over_the_whole_model(self.precision_plugin)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """A plain module under manual optimization: gradients averaged over DP after every
        ``manual_backward`` (as DDP's backward does), so clipping and stepping in
        ``training_step`` see the mean. The mean is linear: accumulating several backwards
        averages their sum."""
        super().post_backward(closure_loss)
        module = self.lightning_module
        assert module is not None  # Lightning calls it while fitting the module
        if self.is_plain_module and not module.automatic_optimization:
            average_gradients_over_dp(module.parameters())

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """A plain module (automatic optimization): gradients averaged over DP once per
        optimizer step, after the closure (the last micro-batch's backward), before
        ``on_before_optimizer_step``, the clipping and the step."""
        module = self.lightning_module
        assert module is not None  # Lightning calls it while fitting the module
        if not self.is_plain_module or not module.automatic_optimization:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_average() -> Any:
            result = closure()
            average_gradients_over_dp(module.parameters())
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    def teardown(self) -> None:
        """Release the plugins; the model stays where it is (its shards live on the devices)."""
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # Collectives ------------------------------------------------------------------------------
    def _comm_device(self) -> torch.device:
        return torch.device("cpu") if dist.get_backend() == "gloo" else self.root_device

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``reduce_op`` over ``group`` (the world by default): ``"mean"`` (default), ``"sum"``
        or a ``ReduceOp``; non-tensors are returned unchanged (as Lightning's DDP)."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        size = self.world_size if group is None else dist.get_world_size(group)
        return reduce_tensor(tensor, group, reduce_op, size)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        if sync_grads:
            raise NotImplementedError("the NxD strategy's all_gather does not carry gradients")
        if not dist.is_initialized():
            return tensor.unsqueeze(0)
        return all_gather_stacked(tensor, group)

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            nxd_state.collectives.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        return broadcast_object(obj, src, self.global_rank, self._comm_device())

    # Checkpoints: every rank saves and loads its shards -----------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """The model and optimizer must exist to load shards into them."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The checkpoint IO restores the optimizer (by parameter name, resharded)."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Not gathered: :meth:`save_checkpoint` hands the model itself to the checkpoint IO."""
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Not gathered: :meth:`save_checkpoint` hands the optimizer itself to the IO."""
        return {}

    def _sharded_model(self) -> nn.Module | None:
        module = self.lightning_module
        if module is None:
            return None
        if self.is_plain_module:
            return module  # its state dict's names are Lightning's own
        model = getattr(module, "model", None)
        return model if isinstance(model, nn.Module) else module

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Collective: every rank writes its shards (the live model and optimizer replace the
        placeholders Lightning put in ``checkpoint``)."""
        checkpoint = dict(checkpoint)
        checkpoint["state_dict"] = self._sharded_model()
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = list(self.optimizers)
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Collective: load the model (and the optimizer, when fitting) in place; returns
        Lightning's loop state for it to restore."""
        optimizers = list(self.optimizers)
        io = self.checkpoint_io
        assert isinstance(io, NeuronCheckpointIO)
        return io.load_checkpoint(
            checkpoint_path, model=self._sharded_model(), optimizers=optimizers
        )

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if checkpoint.get(LOADED_KEY):
            return  # loaded in place by load_checkpoint
        super().load_model_state_dict(checkpoint, strict=strict)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


class NeuronXLAStrategy(NxDStrategy):
    """NxD's ``NeuronXLAStrategy(nxd_config=None, tensor_parallel_size=1,
    pipeline_parallel_size=1, save_load_xser=True)``: :class:`NxDStrategy` under NxD's name.

    On Trainium (``PJRT_DEVICE`` set, processes started by ``torchrun``) it runs on the XLA
    device like NxD's; elsewhere it runs on CPU or CUDA as :class:`NxDStrategy` does, TP and PP
    both (NxD's supported TP only).
    """

    def __init__(
        self,
        nxd_config: dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        save_load_xser: bool = True,
        *,
        expert_parallel_size: int = 1,
        debug: bool = False,
        sync_module_states: bool = False,
        checkpoint_io: NeuronCheckpointIO | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            nxd_config,
            tensor_parallel_size,
            pipeline_parallel_size,
            save_load_xser,
            expert_parallel_size=expert_parallel_size,
            debug=debug,
            sync_module_states=sync_module_states,
            checkpoint_io=checkpoint_io,
            **kwargs,
        )


def _is_nxd_module(module: Any) -> bool:
    """Whether ``module`` is a ``NeuronLTModule`` (known by its interface, so the strategy does
    not import the module class that runs under it): it builds its parallel model itself and
    its nxd optimizer reduces, clips and accumulates."""
    return callable(getattr(module, "adopt_trainer_settings", None))
