"""NxD's model wrapper: one object for the model at any TP/PP/DP mix.

``run_train`` is a training step's forward and backward: at PP = 1, ``loss = model(...)``
then ``loss.backward()``; at PP > 1 the pipeline schedule over every micro-batch. Everything
else looks like the local part of the original module: ``named_parameters`` & co. yield only
this rank's tensors under the original model's names, ``state_dict`` is local with those
names, and a Hugging Face model's ``config`` / ``name_or_path`` / ``dtype`` pass through.

Gradients are averaged over data parallelism once per step, by the optimizer wrapper
(``initialize_parallel_optimizer``) when one is built over this model's parameters. At PP > 1
without one (a plain ``torch.optim`` optimizer), ``run_train`` averages them itself after the
schedule, as NxD's pipeline does.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

import nxd_state
from nxd_state import collectives
from nxd_trainer._model_info import ModelInfo
from nxd_trainer.config import NxDConfig

__all__ = ["NxDModel", "select_loss"]

logger = logging.getLogger(__name__)

# Every live NxDModel, so the optimizer wrapper can claim the DP reduction of the one whose
# parameters it is given.
_MODELS: weakref.WeakSet[NxDModel] = weakref.WeakSet()


def select_loss(output: Any, spec: Any = None) -> torch.Tensor:
    """The loss in a model's output per NxD's ``output_loss_value_spec`` (``True``: the output
    is the loss; ``(True, False)``; ``{"loss": True}``; nested), or with ``spec=None`` the
    output itself, its ``"loss"`` entry or its first element: ``nxd_pipeline.select_loss``,
    so PP = 1 and PP > 1 read the loss alike."""
    from nxd_pipeline import select_loss as pipeline_select_loss

    return pipeline_select_loss(output, spec)


class NxDModel(nn.Module):
    """NxD's ``NxDModel``: the wrapped model (see the module docstring)."""

    # Any: the model, or at PP > 1 an NxDPPModel (its stages, run_train, ... are read),
    # both branches taken on pp_enabled.
    module: Any

    def __init__(self, module: nn.Module, nxd_config: NxDConfig, info: ModelInfo) -> None:
        super().__init__()
        self.module = module
        self.trainer_config = nxd_config
        self.nxd_config = nxd_config.to_nxd()
        self.pp_enabled = nxd_config.pipeline_parallel_size > 1
        self.info = info
        pipe = nxd_config.pipeline_config
        flag = pipe.use_optimizer_wrapper if pipe is not None else None
        # Who averages gradients over DP at PP > 1: "optimizer", "pipeline" (NxDPPModel, when
        # the config says no optimizer wrapper) or None: the optimizer if one claims this model.
        self.dp_reduction: str | None = {True: "optimizer", False: "pipeline", None: None}[flag]
        self.optimizer_claimed = False
        # Context parallelism: the algorithm whose split run_train/run_eval/forward apply.
        cp = nxd_config.context_parallel_size > 1
        self.cp_algorithm = nxd_config.context_parallel_algorithm if cp else None
        self.train()
        _MODELS.add(self)

    def __repr__(self) -> str:
        return f"NxDModel({self.module!r})"

    # NxD API ----------------------------------------------------------------------------
    def local_module(self) -> nn.Module:
        """The unwrapped local module: the model at PP = 1; at PP > 1 this rank's stages
        (an ``nn.ModuleDict`` of stage index -> stage module)."""
        return self.module.stages if self.pp_enabled else self.module

    def local_modules(self) -> list[nn.Module]:
        """NxD's list form: ``[model]``, or this rank's stage modules."""
        return list(self.module.stages.values()) if self.pp_enabled else [self.module]

    def run_train(self, *args: Any, **kwargs: Any) -> Any:
        """One training step's forward and backward; returns the loss.

        PP = 1: ``loss = model(*args, **kwargs)`` (the loss picked out of the output as in
        :func:`select_loss`), ``loss.backward()``. PP > 1: the pipeline schedule; positional
        arguments are matched to ``pipeline_config["input_names"]``; the loss is returned as
        the pipeline returns it (None on ranks that do not hold it, unless
        ``broadcast_and_average_loss``).
        """
        self.train()
        if not self.pp_enabled:
            args, kwargs = self._cp_split(args, kwargs)
            spec = self._loss_spec()
            loss = select_loss(self.module(*args, **kwargs), spec)
            loss.backward()
            return loss.detach()
        loss = self.module.run_train(**self._pipeline_inputs(args, kwargs))
        if self._model_reduces_gradients():
            state = nxd_state.get_parallel_state()
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            collectives.all_reduce_bucketed(grads, state.data_context_parallel_group, average=True)
        return self._loss_out(loss)

    def run_eval(self, *args: Any, **kwargs: Any) -> Any:
        """Forward without gradients in eval mode; returns the loss (PP > 1: as ``run_train``)
        or, at PP = 1, the model's output."""
        self.eval()
        if not self.pp_enabled:
            args, kwargs = self._cp_split(args, kwargs)
            with torch.no_grad():
                return self.module(*args, **kwargs)
        return self._loss_out(self.module.run_eval(**self._pipeline_inputs(args, kwargs)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.pp_enabled:
            raise RuntimeError(
                "with pipeline parallelism the model runs whole steps: call "
                "model.run_train(...) (forward + backward) or model.run_eval(...)"
            )
        args, kwargs = self._cp_split(args, kwargs)
        return self.module(*args, **kwargs)

    def _cp_split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """At context parallelism: this CP rank's inputs (whole sequences in, its slice out:
        ``nxd_trainer._context_parallel``); the outputs (logits, hidden states) are then this
        rank's tokens, in the split's order, and the loss is the whole sequence's mean once
        averaged over CP."""
        if self.cp_algorithm is None:
            return args, kwargs
        from nxd_trainer._context_parallel import split_context_parallel_inputs

        return (), split_context_parallel_inputs(args, kwargs, self.cp_algorithm)

    # Pipeline helpers ---------------------------------------------------------------------
    def _loss_spec(self) -> Any:
        pipe = self.trainer_config.pipeline_config
        return pipe.output_loss_value_spec if pipe is not None else None

    def _pipeline_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The pipeline's keyword inputs: positional ``args`` matched to ``input_names``; at
        context parallelism this CP rank's split (``_context_parallel.split_pipeline_inputs``)
        of the whole sequences given by the user's ``input_names``. ``num_items_in_batch`` is
        refused: the pipeline averages its micro-batches' losses (NxD's convention), so a sum
        divided by a count of the whole batch would be ``num_microbatches`` times too small."""
        pipe = self.trainer_config.pipeline_config
        if self.cp_algorithm is not None:  # the user's names; the stages' add CP's inputs
            names = list(pipe.input_names or ()) if pipe is not None else []
        else:
            names = list(self.module.input_names)
        inputs = self._named(args, kwargs, names)
        if inputs.get("num_items_in_batch") is not None:
            raise ValueError(
                "num_items_in_batch with pipeline parallelism: the pipeline averages its "
                "micro-batches' losses, each micro-batch's loss its own token mean, so a loss "
                "divided by num_items_in_batch would be num_microbatches times too small; "
                "leave it out"
            )
        if self.cp_algorithm is None:
            return inputs
        from nxd_trainer._context_parallel import split_pipeline_inputs

        return split_pipeline_inputs(inputs, self.cp_algorithm)

    @staticmethod
    def _named(args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str]) -> dict[str, Any]:
        if len(args) > len(names):
            raise TypeError(
                f"run_train got {len(args)} positional inputs but the pipeline takes "
                f"{len(names)}: {names}"
            )
        doubled = [n for n in names[: len(args)] if n in kwargs]
        if doubled:
            raise TypeError(f"inputs {doubled} given both by position and by name")
        return {**dict(zip(names, args)), **kwargs}

    def _model_reduces_gradients(self) -> bool:
        """At PP > 1: whether run_train must average gradients over DP (no optimizer wrapper)."""
        if self.dp_reduction is not None:
            return False  # the optimizer wrapper, or the pipeline itself, does it
        return not self.optimizer_claimed

    def _loss_out(self, loss: Any) -> Any:
        pipe = self.trainer_config.pipeline_config
        if pipe is not None and pipe.return_loss_on_cpu:
            if isinstance(loss, torch.Tensor):
                return loss.cpu()
            if isinstance(loss, list):
                return [t.cpu() for t in loss]
        return loss

    # torch.nn.Module API, local to this rank --------------------------------------------
    def _stages(self) -> list[nn.Module]:
        return list(self.module.stages.values())

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names."""
        if not self.pp_enabled:
            yield from self.module.named_parameters(prefix, recurse, remove_duplicate)
            return
        for name, param in self.module.local_named_parameters():
            yield prefix + name, param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.pp_enabled:
            yield from self.module.named_buffers(prefix, recurse, remove_duplicate)
            return
        seen: set[int] = set()
        for stage in self._stages():
            for name, buffer in stage.named_buffers(prefix, recurse, remove_duplicate):
                if id(buffer) not in seen:
                    seen.add(id(buffer))
                    yield name, buffer

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        if not self.pp_enabled:
            yield from self.module.named_children()
            return
        seen: set[int] = set()
        for stage in self._stages():
            for name, child in stage.named_children():
                if id(child) not in seen:
                    seen.add(id(child))
                    yield name, child

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        if not self.pp_enabled:
            yield from self.module.named_modules(memo, prefix, remove_duplicate)
            return
        for name, module in self.module.local_named_modules():
            yield prefix + name, module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's parameters and buffers under the original names (with LoRA, what its
        save mode asks for)."""
        if not self.pp_enabled:
            return self.module.state_dict(*args, **kwargs)
        return self.module.local_state_dict()

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a :meth:`state_dict` (this rank's tensors, original names)."""
        if not self.pp_enabled:
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        local = self.module.local_state_dict()
        unexpected = sorted(k for k in state_dict if k not in local)
        missing = sorted(k for k in local if k not in state_dict)
        if strict and (unexpected or missing):
            raise RuntimeError(
                f"state dict does not match this rank's stages: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}"
            )
        for stage in self._stages():
            own = stage.state_dict()
            stage.load_state_dict(
                {k: v for k, v in state_dict.items() if k in own}, strict=False, assign=assign
            )
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # Hugging Face shortcuts ----------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's (local) floating-point parameters, as Hugging Face's."""
        for param in self.parameters():
            if param.is_floating_point():
                return param.dtype
        return self.info.dtype or torch.get_default_dtype()

    @property
    def config(self) -> Any:
        """A Hugging Face model's ``config`` (else the wrapped module's ``config``, if any)."""
        if self.info.hf_config is not None:
            return self.info.hf_config
        return self.__getattr__("config")

    @property
    def name_or_path(self) -> str | None:
        """A Hugging Face model's ``name_or_path``."""
        if self.info.is_hf:
            return self.info.name_or_path
        return self.__getattr__("name_or_path")

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module (as in NxD)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "info"):
                raise
        try:
            return getattr(self.module, name)
        except AttributeError:
            info = self.__dict__.get("info")
            wrapped = info.class_name if info is not None else "module"
            raise AttributeError(
                f"NxDModel has no attribute {name!r}, nor has the wrapped {wrapped} "
                f"(config, name_or_path: Hugging Face models only)"
            ) from None


def claim_dp_reduction(parameters: Iterable[torch.Tensor]) -> list[NxDModel]:
    """Mark the NxDModels holding any of ``parameters``: an optimizer wrapper over them
    averages their gradients over DP, so their ``run_train`` must not. Returns them."""
    ids = {id(p) for p in parameters}
    claimed = []
    for model in list(_MODELS):
        if any(id(p) in ids for p in model.parameters()):
            model.optimizer_claimed = True
            claimed.append(model)
    return claimed
