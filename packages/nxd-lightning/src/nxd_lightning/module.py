"""``NeuronLTModule``: NxD's LightningModule, built on the trainer API.

* ``setup`` builds the model with ``initialize_parallel_model(nxd_config, model_fn,
  include_buffers, *model_args, **model_kwargs)`` (each rank its TP shards / PP stages, on
  its device);
* ``configure_optimizers`` builds ``initialize_parallel_optimizer(nxd_config, opt_cls,
  param_groups, **opt_kwargs)`` and ``scheduler_cls(optimizer, *scheduler_args,
  **scheduler_kwargs)``;
* optimisation is manual (NxD supports nothing else): each ``training_step`` runs one
  micro-batch through ``model.run_train`` (forward + backward; the pipeline schedule at
  PP > 1, where the loss exists on the last stage only), and every ``grad_accum_steps``
  micro-batches the optimizer steps on their mean gradient, then the scheduler;
* the step's loss, averaged over DP, is logged in the step (``loss``, ``lr``, ``grad_norm``,
  ``global_step``) from the ranks that hold it: the last pipeline stage, or every stage with
  ``log_rank0`` (one broadcast per step); ranks without it log NaN. The progress bar and the
  TensorBoard logger show one rank's (see :mod:`nxd_lightning.progress_bar`).

A custom ``training_step`` calls the same two pieces::

    def training_step(self, batch, batch_idx):
        loss = self.train_micro_batch(batch)  # run_train + loss bookkeeping
        if self.finish_step(batch_idx):  # optimizer/scheduler step every grad_accum_steps
            self.log_step()
        return loss
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import nxd_state
from nxd_lightning._loss import reduce_step_loss
from nxd_lightning._ranks import logging_pipeline_rank

__all__ = ["NeuronLTModule"]


def _check_callable(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__qualname__}")


def _with_clipping(config: dict[str, Any], clip: float) -> dict[str, Any]:
    """``config`` with its ``optimizer_config`` (a dict or an ``nxd_optim.OptimizerConfig``,
    read through that class, so a bad key fails here) clipping at ``clip``, as NxD's dict; a
    warning when the config clipped at another value it gave."""
    from nxd_optim import OptimizerConfig

    given = config.get("optimizer_config")
    optimizer = OptimizerConfig.from_nxd(given)
    explicit = isinstance(given, OptimizerConfig) or "max_grad_norm" in (given or {})
    if optimizer.grad_clipping and explicit and optimizer.max_grad_norm != clip:
        rank_zero_warn(
            f"Trainer(gradient_clip_val={clip}) replaces nxd_config's "
            f"optimizer_config max_grad_norm={optimizer.max_grad_norm}"
        )
    clipped = dataclasses.replace(optimizer, grad_clipping=True, max_grad_norm=clip)
    return {**config, "optimizer_config": dataclasses.asdict(clipped)}


def _inner(optimizer: Any) -> Any:
    """The NxD optimizer inside Lightning's wrapper; it must offer ``scale_gradients``."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not callable(getattr(inner, "scale_gradients", None)):
        raise TypeError(
            f"grad_accum_steps > 1 needs an optimizer with scale_gradients(factor) (nxd's "
            f"NxDOptimizer, from configure_optimizers), got {type(inner).__qualname__}"
        )
    return inner


def _run(fn: Callable[..., Any], batch: Any) -> Any:
    """``fn`` on a batch: a mapping as keyword inputs, a tuple/list as positional ones."""
    if isinstance(batch, Mapping):
        return fn(**batch)
    if isinstance(batch, (tuple, list)):
        return fn(*batch)
    return fn(batch)


def _signature_model_fn_first(
    model_fn: Callable[..., torch.nn.Module] | None = None,
    nxd_config: Any = None,
    opt_cls: Any = None,
    scheduler_cls: Callable[..., Any] | None = None,
    model_args: tuple = (),
    model_kwargs: dict[str, Any] | None = None,
    opt_args: tuple = (),
    opt_kwargs: dict[str, Any] | None = None,
    scheduler_args: tuple = (),
    scheduler_kwargs: dict[str, Any] | None = None,
    grad_accum_steps: int = 1,
    log_rank0: bool = False,
    manual_opt: bool = True,
    *,
    train_batch_size: int = 16,
    logging_interval: int = 1,
) -> None:
    """NxD's earlier order (its API reference): ``model_fn`` first."""


def _signature_config_first(
    nxd_config: Any = None,
    opt_cls: Any = None,
    scheduler_cls: Callable[..., Any] | None = None,
    model_args: tuple = (),
    model_kwargs: dict[str, Any] | None = None,
    opt_args: tuple = (),
    opt_kwargs: dict[str, Any] | None = None,
    scheduler_args: tuple = (),
    scheduler_kwargs: dict[str, Any] | None = None,
    model_fn: Callable[..., torch.nn.Module] | None = None,
    grad_accum_steps: int = 1,
    train_batch_size: int = 16,
    logging_interval: int = 1,
    log_rank0: bool = False,
    manual_opt: bool = True,
) -> None:
    """NxD's current order (its code): ``nxd_config`` first, ``model_fn`` an optional keyword
    after ``scheduler_kwargs``."""


def _bind(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments by name, under whichever of NxD's two orders the call uses: the first
    positional is ``nxd_config`` (a dict or an ``NxDConfig``, never callable) in the current
    one, ``model_fn`` (callable or None) in the earlier one; keyword-only calls bind the same
    under both."""
    from nxd_trainer import NxDConfig

    first = args[0] if args else None
    config_first = isinstance(first, Mapping | NxDConfig)
    signature = inspect.signature(
        _signature_config_first if config_first else _signature_model_fn_first
    )
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        order = (
            "nxd_config, opt_cls, scheduler_cls"
            if config_first
            else ("model_fn, nxd_config, opt_cls, scheduler_cls")
        )
        raise TypeError(f"NeuronLTModule({order}, ...): {error}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _check_arguments(bound: dict[str, Any]) -> None:
    """Refuse, naming the value, what the module cannot run: ``manual_opt=False`` (NxD
    supports manual optimisation only), a ``grad_accum_steps`` that is not a positive int, no
    ``nxd_config``, a ``model_fn`` / ``scheduler_cls`` that is neither None nor callable, an
    ``opt_cls`` that is not a ``torch.optim.Optimizer`` subclass."""
    if not bound["manual_opt"]:
        raise ValueError(
            "NeuronLTModule(manual_opt=False): automatic optimization is not supported (as "
            "in NxD); use manual_opt=True: the module's training_step runs each micro-batch "
            "and steps the optimizer every grad_accum_steps"
        )
    grad_accum_steps = bound["grad_accum_steps"]
    if (
        not isinstance(grad_accum_steps, int)
        or isinstance(grad_accum_steps, bool)
        or (grad_accum_steps < 1)
    ):
        raise ValueError(f"grad_accum_steps must be a positive integer, got {grad_accum_steps!r}")
    if bound["nxd_config"] is None:
        raise TypeError("NeuronLTModule needs nxd_config (from neuronx_distributed_config)")
    _check_callable("model_fn", bound["model_fn"], allow_none=True)
    _check_callable("scheduler_cls", bound["scheduler_cls"], allow_none=True)
    opt_cls = bound["opt_cls"]
    if not (isinstance(opt_cls, type) and issubclass(opt_cls, torch.optim.Optimizer)):
        raise TypeError(f"opt_cls must be a torch.optim.Optimizer subclass, got {opt_cls!r}")


class NeuronLTModule(LightningModule):
    """NxD's ``NeuronLTModule``, under both of NxD's argument orders: its current
    ``NeuronLTModule(nxd_config, opt_cls, scheduler_cls, model_args=(), model_kwargs={},
    opt_args=(), opt_kwargs={}, scheduler_args=(), scheduler_kwargs={}, model_fn=None,
    grad_accum_steps=1, train_batch_size=16, logging_interval=1, log_rank0=False,
    manual_opt=True)`` and its API reference's earlier ``NeuronLTModule(model_fn, nxd_config,
    opt_cls, scheduler_cls, model_args=(), ..., grad_accum_steps=1, log_rank0=False,
    manual_opt=True)``; the first positional argument tells them apart (a config is a dict, a
    ``model_fn`` is callable) (module docstring).

    ``model_fn`` may be None, as in NxD: a subclass then builds ``self.model`` in its own
    ``setup()`` (NxD's Llama example does). The base ``setup(stage, include_buffers=False)``
    refuses to run without it. ``nxd_config`` and ``opt_cls`` are required.
    ``scheduler_cls`` may be None (no scheduler). ``opt_args`` are bound to ``opt_cls``'s
    parameters after ``params``. ``manual_opt=False`` is refused, as NxD documents that only
    manual optimisation is supported. ``train_batch_size`` and ``logging_interval`` are kept
    as attributes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _bind(args, kwargs)
        super().__init__()
        _check_arguments(bound)
        from nxd_trainer import NxDConfig

        nxd_config = bound["nxd_config"]
        config = NxDConfig.from_nxd(nxd_config)  # validates every key, builds no group
        self.nxd_config = nxd_config if isinstance(nxd_config, Mapping) else config.to_nxd()
        self.model_fn = bound["model_fn"]
        self.opt_cls = bound["opt_cls"]
        self.scheduler_cls = bound["scheduler_cls"]
        self.model_args = tuple(bound["model_args"])
        self.model_kwargs = dict(bound["model_kwargs"] or {})
        self.opt_args = tuple(bound["opt_args"])
        self.opt_kwargs = dict(bound["opt_kwargs"] or {})
        self.scheduler_args = tuple(bound["scheduler_args"])
        self.scheduler_kwargs = dict(bound["scheduler_kwargs"] or {})
        self.grad_accum_steps = bound["grad_accum_steps"]
        self.log_rank0 = bool(bound["log_rank0"])
        self.train_batch_size = bound["train_batch_size"]
        self.logging_interval = bound["logging_interval"]
        self.automatic_optimization = False
        self._tensor_parallel_size = config.tensor_parallel_size
        self._pipeline_parallel_size = config.pipeline_parallel_size
        self._expert_parallel_size = config.expert_parallel_size
        # What the last optimizer step reported (NxD's attribute names).
        self.loss: torch.Tensor | None = None
        self.lr: float | None = None
        self.global_norm: torch.Tensor | None = None
        self.should_print = False
        self.averaged_loss: torch.Tensor | None = None
        self._holds_loss = False
        self.print_pp_rank = 0

    # Building -------------------------------------------------------------------------------
    def setup(self, stage: str | None = None, include_buffers: bool = False) -> None:
        """Build ``self.model = initialize_parallel_model(nxd_config, model_fn,
        include_buffers, *model_args, **model_kwargs)`` (once)."""
        if isinstance(getattr(self, "model", None), torch.nn.Module):
            return  # fit, then validate: built once
        from nxd_lightning.strategy import NxDStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, NxDStrategy):
            raise TypeError(
                f"NeuronLTModule runs under NxDStrategy / NeuronXLAStrategy, got "
                f"{type(strategy).__qualname__}"
            )
        wanted = (
            self._tensor_parallel_size,
            self._pipeline_parallel_size,
            self._expert_parallel_size,
        )
        have = (
            strategy.tensor_parallel_size,
            strategy.pipeline_parallel_size,
            strategy.expert_parallel_size,
        )
        if wanted != have:
            raise ValueError(
                f"the module's nxd_config has tensor_parallel_size={wanted[0]}, "
                f"pipeline_parallel_size={wanted[1]}, expert_parallel_size={wanted[2]} but the "
                f"strategy runs {have[0]}, {have[1]} and {have[2]}: give both the same config"
            )
        if self.model_fn is None:
            raise TypeError(
                f"{type(self).__qualname__}: model_fn is None, so the model cannot be built; "
                f"pass model_fn=..., or override setup() to build self.model (NxD's Llama "
                f"example does)"
            )
        from nxd_trainer import initialize_parallel_model

        self.model = initialize_parallel_model(
            dict(self.nxd_config),
            self.model_fn,
            include_buffers,
            *self.model_args,
            **self.model_kwargs,
        )
        device = nxd_state.current_device()
        self.averaged_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.print_pp_rank = logging_pipeline_rank(self.log_rank0)

    def adopt_trainer_settings(self, trainer: Any) -> None:
        """Lightning's ``Trainer(gradient_clip_val=c, accumulate_grad_batches=k)`` for this
        manually optimized module (Lightning refuses both under manual optimization; the
        strategy calls this first and clears them on the Trainer):

        * ``k`` -> ``grad_accum_steps = k``: the optimizer steps on the mean of k
          micro-batches' gradients (the larger batch's), as ``accumulate_grad_batches`` gives
          an automatically optimized module; a different ``grad_accum_steps`` > 1 is refused;
        * ``c`` -> ``optimizer_config["grad_clipping"] = True, ["max_grad_norm"] = c``: the
          nxd optimizer clips by the norm of the whole model (over TP and PP), the
          one-process model's norm; it replaces the config's ``max_grad_norm`` (with a
          warning when that clipped at another value). ``gradient_clip_algorithm="value"`` is
          refused (the nxd optimizer clips by norm).
        """
        accumulate = trainer.accumulate_grad_batches
        if accumulate != 1:
            if self.grad_accum_steps not in (1, accumulate):
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={accumulate}) contradicts the module's "
                    f"grad_accum_steps={self.grad_accum_steps}: give one of them"
                )
            self.grad_accum_steps = accumulate
            trainer.accumulate_grad_batches = 1
        clip = trainer.gradient_clip_val
        if clip is not None and clip > 0:
            algorithm = trainer.gradient_clip_algorithm
            if algorithm is not None and str(algorithm).lower().endswith("value"):
                raise ValueError(
                    f"Trainer(gradient_clip_algorithm={algorithm!r}) with a NeuronLTModule: the "
                    f"nxd optimizer clips by norm only; expected gradient_clip_algorithm='norm'"
                )
            self.nxd_config = _with_clipping(dict(self.nxd_config), float(clip))
            trainer.gradient_clip_val = None

    def get_param_groups_by_weight_decay(self) -> list[dict[str, Any]]:
        """NxD's default groups: weight decay 0.01, none for biases and ``LayerNorm`` weights.
        Override for other groups."""
        named = list(self.model.named_parameters())
        no_decay = ("bias", "LayerNorm")
        return [
            {
                "params": [p for n, p in named if not any(nd in n for nd in no_decay)],
                "weight_decay": 0.01,
            },
            {
                "params": [p for n, p in named if any(nd in n for nd in no_decay)],
                "weight_decay": 0.0,
            },
        ]

    def _optimizer_defaults(self) -> dict[str, Any]:
        defaults = dict(self.opt_kwargs)
        if self.opt_args:
            names = list(inspect.signature(self.opt_cls).parameters)[1:]  # after params
            if len(self.opt_args) > len(names):
                raise TypeError(
                    f"opt_args has {len(self.opt_args)} values but {self.opt_cls.__name__} "
                    f"takes {len(names)} after params: {names}"
                )
            for name, value in zip(names, self.opt_args):
                if name in defaults:
                    raise TypeError(f"{name!r} given in both opt_args and opt_kwargs")
                defaults[name] = value
        return defaults

    def configure_optimizers(self) -> Any:
        from nxd_trainer import initialize_parallel_optimizer

        optimizer = initialize_parallel_optimizer(
            dict(self.nxd_config),
            self.opt_cls,
            self.get_param_groups_by_weight_decay(),
            **self._optimizer_defaults(),
        )
        optimizer.zero_grad()
        if self.scheduler_cls is None:
            return [optimizer]
        scheduler = self.scheduler_cls(optimizer, *self.scheduler_args, **self.scheduler_kwargs)
        return [optimizer], [{"scheduler": scheduler}]

    # Training -------------------------------------------------------------------------------
    def train_micro_batch(self, batch: Any) -> torch.Tensor | None:
        """``model.run_train`` on one micro-batch (a mapping: keyword inputs; a tuple: positional
        ones); returns its loss (None on pipeline ranks that do not hold it)."""
        loss = _run(self.model.run_train, batch)
        if isinstance(loss, list):  # return_mb_loss: the micro-batches' losses
            loss = torch.stack([item.detach() for item in loss]).mean() if loss else None
        if loss is not None:
            assert self.averaged_loss is not None
            self.averaged_loss += loss.detach().to(self.averaged_loss) / self.grad_accum_steps
            self._holds_loss = True
        return loss

    def finish_step(self, batch_idx: int) -> bool:
        """After micro-batch ``batch_idx``: every ``grad_accum_steps`` micro-batches, step the
        optimizer on the mean gradient, zero it, step the scheduler and record the step's
        loss (DP mean), learning rate and gradient norm. Returns whether it stepped."""
        if (batch_idx + 1) % self.grad_accum_steps != 0:
            return False
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list), "NeuronLTModule configures one optimizer"
        if self.grad_accum_steps > 1:
            # G = Σ_k ∇L_k -> G / k, the mean (the larger batch's gradient), wherever the
            # optimizer keeps G (p.grad, fp32 accumulators, ZeRO-1's). The reductions in step()
            # are linear, so this equals scaling each loss, which at PP > 1 the pipeline's
            # own backward does not allow.
            _inner(optimizer).scale_gradients(1.0 / self.grad_accum_steps)
        self.lr = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        self.global_norm = getattr(optimizer.optimizer, "grad_norm", None)
        optimizer.zero_grad()
        scheduler = self.lr_schedulers()
        assert not isinstance(scheduler, list), "NeuronLTModule configures one scheduler"
        if scheduler is not None:
            scheduler.step()
        assert self.averaged_loss is not None
        held = self.averaged_loss if self._holds_loss else None
        self.loss = reduce_step_loss(held, self.log_rank0)
        self.averaged_loss.zero_()
        self._holds_loss = False
        self.should_print = True
        nxd_state.mark_step()
        return True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        self.should_print = False
        loss = self.train_micro_batch(batch)
        if self.finish_step(batch_idx):
            self.log_step()
        return loss

    def log_step(self) -> None:
        """Log the last optimizer step: ``loss`` (NaN on ranks that do not hold it), ``lr``,
        ``grad_norm`` (with clipping) and ``global_step``; the first two on the progress bar."""
        loss = self.loss.item() if self.loss is not None else math.nan
        self.log("loss", loss, prog_bar=True)
        if self.lr is not None:
            self.log("lr", self.lr, prog_bar=True)
        if self.global_norm is not None:
            self.log("grad_norm", float(self.global_norm))
        self.log("global_step", float(self.global_step))

    # Validation -------------------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        """``model.run_eval`` on the batch; logs ``val_loss`` (DP mean, averaged over the epoch;
        NaN on ranks that do not hold it)."""
        from nxd_trainer import select_loss

        output = _run(self.model.run_eval, batch)
        if self._pipeline_parallel_size == 1:
            pipe = self.model.trainer_config.pipeline_config
            output = select_loss(output, pipe.output_loss_value_spec if pipe else None)
        if isinstance(output, list):
            output = torch.stack(output).mean() if output else None
        loss = reduce_step_loss(output, self.log_rank0)
        value = loss.item() if loss is not None else math.nan
        self.log("val_loss", value, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    # Prediction --------------------------------------------------------------------------------
    predict_gathers_vocabulary: bool = True
    """``predict_step`` returns full-vocabulary logits (gathered over TP) when the model's output
    embedding is vocabulary-parallel; set False (on the class or the instance) to get this TP
    rank's slice of the vocabulary instead."""

    def predict_step(self, batch: Any, batch_idx: int = 0, dataloader_idx: int = 0) -> Any:
        """``model(**batch)`` without gradients; a vocabulary-parallel output's logits gathered
        over TP (:meth:`gather_vocabulary`) unless ``predict_gathers_vocabulary`` is False."""
        if self._pipeline_parallel_size > 1:
            raise NotImplementedError(
                f"predict at pipeline_parallel_size={self._pipeline_parallel_size}: the pipeline "
                f"runs only training and evaluation schedules; expected pipeline_parallel_size=1 "
                f"(load the checkpoint at PP=1 to predict)"
            )
        with torch.no_grad():
            output = _run(self.model, batch)
        return self.gather_vocabulary(output) if self.predict_gathers_vocabulary else output

    def gather_vocabulary(self, output: Any) -> Any:
        """``logits`` (a tensor, or an output's ``.logits``) <- [logits_0, ..., logits_{T-1}]
        along the last dimension over TP, when the model's output embedding
        (``get_output_embeddings()``) is a column-parallel layer without ``gather_output``; the
        output unchanged otherwise. Padded vocabularies are refused (no guess at the padding)."""
        from nxd_layers import BaseParallelLinear
        from nxd_layers.mappings import gather_from_tensor_model_parallel_region

        local = getattr(self.model, "local_module", None)
        module = local() if callable(local) else self.model
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if not isinstance(head, BaseParallelLinear) or getattr(head, "gather_output", True):
            return output
        logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor):
            return output
        full = gather_from_tensor_model_parallel_region(logits)
        vocab = getattr(getattr(module, "config", None), "vocab_size", full.shape[-1])
        if full.shape[-1] != vocab:
            raise ValueError(
                f"the gathered logits have {full.shape[-1]} columns but the vocabulary has "
                f"{vocab} (padded for tensor parallelism): set predict_gathers_vocabulary=False "
                f"and remove the padding yourself"
            )
        if isinstance(output, torch.Tensor):
            return full
        output.logits = full
        return output

    # NxD's module API ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the optimizer wrapper clips (``optimizer_config['grad_clipping']``)."""

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the optimizer wrapper clips."""

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The model's local state dict under its original names (as NxD's)."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        model = self._modules.get("model")
        if model is None:
            raise RuntimeError(
                f"{type(self).__qualname__}.load_state_dict: the model is built in setup() "
                f"(initialize_parallel_model), so there is nothing to load into yet. Load an "
                f"nxd checkpoint folder with Trainer.fit / validate / test / predict(..., "
                f"ckpt_path=folder), or build the unparallelized model with model_fn and load "
                f"the folder's whole tensors with Model.load_from_checkpoint on a plain "
                f"LightningModule"
            )
        return model.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's parameters (NxD's: the wrapped model's, original names)."""
        model = self._modules.get("model")
        if model is None:
            return super().named_parameters(*args, **kwargs)
        return model.named_parameters(*args, **kwargs)
