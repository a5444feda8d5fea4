"""optimum-neuron's ``Parallelizer``: tensor (+ sequence, + pipeline) parallelism for an
unmodified Hugging Face causal LM, in place.

``parallelize`` runs, on every rank:

1. checks (model family, degrees, heads, pipeline inputs) before any change or collective;
2. the swap (:mod:`nxd_trainer.hf._swap`): linears and embedding become nxd's parallel layers
   on ``meta``, the attention forward sees local heads, the loss runs on sharded logits;
3. PP > 1: :class:`nxd_pipeline.NxDPPModel` (``tracer_cls="hf"``) cuts the layers evenly into
   stages and keeps this rank's;
4. in waves of ``num_local_ranks_per_step`` local ranks, this rank's tensors are allocated on
   its device and filled: from the model's own (eager) weights, or from a Hugging Face folder
   (``checkpoint_dir``, or the folder a model was lazily loaded from) reading only this rank's
   rows/columns; an nxd-ckpt sharded checkpoint in ``checkpoint_dir`` is loaded after.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

import nxd_state
from nxd_trainer.hf._rules import inspect_fast_path
from nxd_trainer.hf._sources import HF_INDEX_NAME, HF_WEIGHTS_NAME, FolderStore
from nxd_trainer.hf._swap import GQA_NAME, Layout, Plan, layout_for, make_meta, swap_layers
from nxd_trainer.hf.spec import ModelSpec

__all__ = ["Parallelizer"]

logger = logging.getLogger(__name__)

LAZY_FOLDER = "_nxd_lazy_folder"
"""Attribute of a model built under ``lazy_load_for_parallelism``: its Hugging Face folder."""


def _decoder_stack(model: nn.Module, path: str) -> nn.ModuleList | nn.Sequential:
    """The decoder layers at ``path`` (a ModuleList in every transformers family)."""
    stack = model.get_submodule(path)
    if not isinstance(stack, nn.ModuleList | nn.Sequential):
        raise TypeError(f"{path} must be a ModuleList of decoder layers, got {type(stack)}")
    return stack


def _is_hf_folder(path: Path) -> bool:
    return (path / HF_WEIGHTS_NAME).is_file() or (path / HF_INDEX_NAME).is_file()


def _release_plan(model: nn.Module) -> None:
    """Drop the swap's plan from ``model``, and with it the references to the original full
    tensors it read from."""
    plan = model.__dict__.pop("_nxd_plan", None)
    if plan is not None:
        plan.memory.tensors.clear()


def _local_ranks_per_step(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_local_ranks_per_step must be an int, got {value!r}")
    if value <= 0:  # optimum-neuron: every local rank at once
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return value


class Parallelizer:
    """Parallelises one model family; subclasses set :attr:`spec` (see
    :mod:`nxd_trainer.hf.families`)."""

    spec: ClassVar[ModelSpec]

    fuse_qkv: ClassVar[bool] = False
    """The GQA projection (used when TP exceeds the KV heads) holds one fused ``weight_qkv``
    instead of ``weight_q/k/v`` (default for ``fuse_qkv=None``). Checkpoints are the same
    either way (the Hugging Face names, :mod:`nxd_trainer.hf._swap`)."""

    # Checks -------------------------------------------------------------------------------
    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        """``model`` is a Hugging Face model of this family, not parallelised yet."""
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type != cls.spec.model_type:
            raise ValueError(
                f"{cls.__name__} parallelises model_type {cls.spec.model_type!r}, got "
                f"{type(model).__name__} with model_type {model_type!r}"
            )
        from nxd_layers import BaseParallelLinear, ParallelEmbedding

        if any(isinstance(m, (BaseParallelLinear, ParallelEmbedding)) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} already holds parallel layers")

    @classmethod
    def inspect(
        cls, model: nn.Module, *, sequence_parallel: bool = False, gather_output: bool = False
    ) -> None:
        """Refuse (:class:`~nxd_trainer.hf.UnsupportedModelError`, naming the family and the
        feature) a model whose results this parallelizer would not reproduce exactly."""
        ep = nxd_state.get_expert_model_parallel_size()
        if ep > 1:
            from nxd_trainer.hf._experts import check_experts
            from nxd_trainer.hf._rules import UnsupportedModelError

            tp = nxd_state.get_tensor_model_parallel_size()
            check_experts(model, cls.spec.model_type, ep, tp)  # refuses a dense model
            raise UnsupportedModelError(
                cls.spec.model_type,
                f"expert_model_parallel_size={ep}: the registered ModelSpec path does not "
                f"shard experts (unregister it: transformers' tensor-parallel plan path does)",
            )
        inspect_fast_path(
            model,
            cls.spec,
            nxd_state.get_tensor_model_parallel_size(),
            sequence_parallel=sequence_parallel,
            gather_output=gather_output,
        )

    @classmethod
    def layout(cls, config: Any, tp: int, kv_size_multiplier: int | None) -> Layout:
        """The head split (:func:`~nxd_trainer.hf._swap.layout_for`)."""
        return layout_for(config, tp, kv_size_multiplier)

    # optimum-neuron's API ---------------------------------------------------------------------
    @classmethod
    def _parallelize(
        cls,
        model: nn.Module,
        device: torch.device | None = None,
        parallelize_embeddings: bool = True,
        sequence_parallel_enabled: bool = False,
        should_parallelize_layer_predicate_func: Callable[[nn.Module], bool] | None = None,
        **parallel_layer_specific_kwargs: Any,
    ) -> nn.Module:
        """Swap the layers for parallel ones on ``meta`` (no values yet: :meth:`parallelize`
        fills them). Layer-specific keywords used: ``kv_size_multiplier`` and ``fuse_qkv``
        (None: :attr:`fuse_qkv`)."""
        del device  # the layers are built on meta; parallelize allocates them
        cls.check_model(model)
        gather_output = bool(parallel_layer_specific_kwargs.get("gather_output", False))
        cls.inspect(model, sequence_parallel=sequence_parallel_enabled, gather_output=gather_output)
        fuse_qkv = parallel_layer_specific_kwargs.get("fuse_qkv")
        fuse_qkv = cls.fuse_qkv if fuse_qkv is None else fuse_qkv
        if not isinstance(fuse_qkv, bool):
            raise TypeError(f"fuse_qkv must be a bool or None, got {fuse_qkv!r}")
        layout = cls.layout(
            model.config,
            nxd_state.get_tensor_model_parallel_size(),
            parallel_layer_specific_kwargs.get("kv_size_multiplier"),
        )
        plan = swap_layers(
            model,
            cls.spec,
            layout,
            sequence_parallel=sequence_parallel_enabled,
            parallelize_embeddings=parallelize_embeddings,
            should_parallelize_layer=should_parallelize_layer_predicate_func,
            fuse_qkv=fuse_qkv,
            gather_output=gather_output,
        )
        model.__dict__["_nxd_plan"] = (
            plan  # parallelize reads it (and removes it); a plain attribute
        )
        return model

    @classmethod
    def parallelize(
        cls,
        model: nn.Module,
        device: torch.device | None = None,
        parallelize_embeddings: bool = True,
        sequence_parallel_enabled: bool = False,
        kv_size_multiplier: int | None = None,
        pipeline_parallel_input_names: list[str] | tuple[str, ...] | None = None,
        pipeline_parallel_num_microbatches: int = 1,
        pipeline_parallel_use_zero1_optimizer: bool = False,
        pipeline_parallel_gradient_checkpointing_enabled: bool = False,
        checkpoint_dir: str | Path | None = None,
        num_local_ranks_per_step: int = 8,
        fuse_qkv: bool | None = None,
        gather_output: bool = False,
    ) -> nn.Module:
        """The parallelised model (an ``nxd_pipeline.NxDPPModel`` when PP > 1) with every
        parameter holding its values (see the module docstring). Collective. ``fuse_qkv``:
        see :attr:`fuse_qkv` (nxd's keyword). ``gather_output``: the LM head's logits are
        gathered over TP to the whole vocabulary (generation, evaluation; the family's own
        loss runs on them) instead of staying vocabulary-sharded for the parallel loss.
        A model this parallelizer would not reproduce exactly is refused first
        (:meth:`inspect`)."""
        from nxd_trainer._materialize import build_in_waves

        swap: dict[str, Any] = {
            "sequence_parallel_enabled": sequence_parallel_enabled,
            "kv_size_multiplier": kv_size_multiplier,
            "fuse_qkv": fuse_qkv,
            "gather_output": gather_output,
        }
        cls._check_arguments(model, pipeline_input_names=pipeline_parallel_input_names, **swap)
        factor = _local_ranks_per_step(num_local_ranks_per_step)
        device = torch.device(device) if device is not None else nxd_state.current_device()
        folder, sharded = cls._weights_source(model, checkpoint_dir)
        pipeline = {
            "input_names": pipeline_parallel_input_names,
            "num_microbatches": pipeline_parallel_num_microbatches,
            "use_zero1_optimizer": pipeline_parallel_use_zero1_optimizer,
            "gradient_checkpointing": pipeline_parallel_gradient_checkpointing_enabled,
        }

        def build() -> nn.Module:
            cls._parallelize(model, parallelize_embeddings=parallelize_embeddings, **swap)
            plan: Plan = model.__dict__["_nxd_plan"]
            return cls._fill(model, plan, device, folder, sharded is not None, pipeline)

        try:
            parallel = build_in_waves(factor, build, device)
        finally:
            _release_plan(model)
        if sharded is not None:  # step 4's values from an nxd-ckpt checkpoint
            import nxd_ckpt

            nxd_ckpt.load_checkpoint(
                sharded, model=parallel, num_workers=min(factor, 32), load_rng=False
            )
        return parallel

    @classmethod
    def _check_arguments(
        cls,
        model: nn.Module,
        *,
        sequence_parallel_enabled: bool,
        kv_size_multiplier: int | None,
        fuse_qkv: bool | None,
        gather_output: bool,
        pipeline_input_names: Any,
    ) -> None:
        """Step 1 of :meth:`parallelize`: everything checkable before any change, on every
        rank (a model it would not reproduce exactly: :meth:`inspect`'s error)."""
        if not nxd_state.model_parallel_is_initialized():
            raise RuntimeError(
                "model parallelism is not initialised: call nxd_state.initialize_model_parallel"
                "(tensor_model_parallel_size=..., pipeline_model_parallel_size=...) first"
            )
        tp = nxd_state.get_tensor_model_parallel_size()
        cls.check_model(model)
        if not isinstance(gather_output, bool):
            raise TypeError(f"gather_output must be a bool, got {gather_output!r}")
        cls.inspect(model, sequence_parallel=sequence_parallel_enabled, gather_output=gather_output)
        if fuse_qkv is not None and not isinstance(fuse_qkv, bool):
            raise TypeError(f"fuse_qkv must be a bool or None, got {fuse_qkv!r}")
        cls.layout(model.config, tp, kv_size_multiplier)
        if sequence_parallel_enabled and tp == 1:
            raise ValueError("sequence_parallel_enabled=True needs tensor_parallel_size > 1")
        if sequence_parallel_enabled and not cls.spec.supports_sequence_parallel:
            raise ValueError(f"{cls.spec.model_type} does not support sequence parallelism")
        if nxd_state.get_pipeline_model_parallel_size() > 1:
            cls._check_pipeline(model, pipeline_input_names)

    @classmethod
    def _fill(
        cls,
        model: nn.Module,
        plan: Plan,
        device: torch.device,
        folder: Path | None,
        deferred: bool,
        pipeline: dict[str, Any],
    ) -> nn.Module:
        """Steps 3-4 of :meth:`parallelize` for the swapped ``model``: its tensors allocated on
        ``device`` and filled from ``plan``'s sources (a folder, or later a checkpoint when
        ``deferred``), at PP > 1 by the pipeline as it builds this rank's stages
        (``pipeline``: :meth:`_pipeline`'s keywords)."""
        from nxd_trainer._materialize import materialize_meta_module

        plan.folder = FolderStore(folder) if folder is not None else None
        plan.deferred = deferred
        if plan.folder is not None or plan.deferred:
            make_meta(model, buffers=False)  # values from the folder / the checkpoint
        if nxd_state.get_pipeline_model_parallel_size() == 1:
            materialize_meta_module(model, device, plan.init_fn())
            return nxd_state.move_model_to_device(model, device)
        make_meta(model, buffers=True)
        return cls._pipeline(model, plan, device, **pipeline)

    @classmethod
    def _weights_source(
        cls, model: nn.Module, checkpoint_dir: str | Path | None
    ) -> tuple[Path | None, Path | None]:
        """(Hugging Face folder to read from, nxd-ckpt checkpoint to load after)."""
        lazy = model.__dict__.get(LAZY_FOLDER)
        if checkpoint_dir is None:
            return (Path(lazy) if lazy is not None else None), None
        path = Path(checkpoint_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint_dir {path} is not a folder")
        if _is_hf_folder(path):
            FolderStore(path)  # a missing shard fails here, on every rank
            return path, None
        import nxd_ckpt

        if not nxd_ckpt.has_checkpoint(path):
            raise FileNotFoundError(
                f"checkpoint_dir {path} is neither a Hugging Face folder ({HF_WEIGHTS_NAME} or "
                f"{HF_INDEX_NAME}) nor an nxd-ckpt checkpoint with a complete tag"
            )
        return (Path(lazy) if lazy is not None else None), path

    @classmethod
    def _check_pipeline(cls, model: nn.Module, input_names: Any) -> None:
        if not cls.spec.supports_pipeline_parallel:
            raise ValueError(f"{cls.spec.model_type} does not support pipeline parallelism")
        if not input_names or not all(isinstance(n, str) for n in input_names):
            raise ValueError(
                f"pipeline parallelism needs pipeline_parallel_input_names (the model's tensor "
                f"inputs, e.g. ['input_ids', 'attention_mask', 'labels']), got {input_names!r}"
            )
        layers = len(_decoder_stack(model, cls.spec.layers))
        pp = nxd_state.get_pipeline_model_parallel_size()
        if layers < pp:
            raise ValueError(f"{layers} decoder layers cannot fill {pp} pipeline stages")

    @classmethod
    def pipeline_cuts(cls, model: nn.Module, stages: int) -> list[str]:
        """Cuts after layers ``k·L/p − 1`` (``L`` layers, ``p`` stages): equal stages."""
        layers = len(_decoder_stack(model, cls.spec.layers))
        return [f"{cls.spec.layers}.{(k + 1) * layers // stages - 1}" for k in range(stages - 1)]

    @classmethod
    def pipeline_leaves(cls, model: nn.Module) -> list[type]:
        """Module classes the pipeline's capture keeps as calls: the decoder layer, and every
        parallel layer and the parallel loss outside it. torch.export would otherwise inline
        their forward into plain operations, dropping the custom backward (the TP collectives
        of the gradients) of their autograd functions."""
        from nxd_layers import BaseParallelLinear, ParallelEmbedding
        from nxd_trainer.hf._loss import ParallelCausalLMLoss

        layer = type(_decoder_stack(model, cls.spec.layers)[0])
        return [layer, ParallelEmbedding, BaseParallelLinear, ParallelCausalLMLoss]

    @classmethod
    def _pipeline(
        cls,
        model: nn.Module,
        plan: Plan,
        device: torch.device,
        input_names: Any,
        num_microbatches: int,
        use_zero1_optimizer: bool,
        gradient_checkpointing: bool,
    ) -> nn.Module:
        """This rank's stages of ``model``, cut evenly after decoder layers; each decoder
        layer is a module call in its stage's graph, so ``gradient_checkpointing`` recomputes
        the local layers' forward in backward (their activations are not kept)."""
        from nxd_pipeline import NxDPPModel

        pipelined = NxDPPModel(
            model,
            num_microbatches=num_microbatches,
            input_names=list(input_names),
            pipeline_cuts=cls.pipeline_cuts(model, nxd_state.get_pipeline_model_parallel_size()),
            tracer_cls="hf",
            leaf_module_cls=[*cls.pipeline_leaves(model)],  # a list[type | str]
            param_init_fn=plan.init_fn(),
            use_zero1_optimizer=use_zero1_optimizer,
            device=device,
        )
        plan.captured()
        if gradient_checkpointing:
            from nxd_trainer.activation_checkpoint import apply_activation_checkpointing

            layer = type(_decoder_stack(model, cls.spec.layers)[0])
            apply_activation_checkpointing(pipelined.local_named_modules(), (layer,))
            config: Any = model.config  # a recomputed layer would append to a cache twice
            config.use_cache = False
        return pipelined

    # Optimizer -------------------------------------------------------------------------------
    @classmethod
    def optimizer_for_mp(
        cls,
        optimizer: torch.optim.Optimizer,
        orig_param_to_parallel_param_on_xla: Mapping[int, nn.Parameter],
    ) -> torch.optim.Optimizer:
        """The optimizer over the parallel parameters (:func:`nxd_trainer.hf.optimizer_for_mp`)."""
        from nxd_trainer.hf.optim import optimizer_for_mp

        return optimizer_for_mp(optimizer, orig_param_to_parallel_param_on_xla)

    # Checkpoints ------------------------------------------------------------------------------
    @classmethod
    def save_model_sharded_checkpoint(
        cls,
        model: nn.Module,
        output_dir: str | Path,
        optimizer: torch.optim.Optimizer | None = None,
        use_xser: bool = True,
        async_save: bool = False,
        num_local_ranks_per_step: int = 8,
    ) -> None:
        from nxd_trainer.hf.checkpoint import save_model_sharded_checkpoint

        save_model_sharded_checkpoint(
            model, output_dir, optimizer, use_xser, async_save, num_local_ranks_per_step
        )

    @classmethod
    def load_model_sharded_checkpoint(cls, model: nn.Module, load_dir: str | Path) -> None:
        from nxd_trainer.hf.checkpoint import load_model_sharded_checkpoint

        load_model_sharded_checkpoint(model, load_dir)

    @classmethod
    def hf_name(cls, name: str) -> str:
        """The Hugging Face name of a parallel model's tensor (the GQA projection's parts are
        ``q_proj`` / ``k_proj`` / ``v_proj`` there; a fused ``weight_qkv``: the first,
        :meth:`hf_names` lists all three)."""
        return cls.hf_names(name)[0]

    @classmethod
    def hf_names(cls, name: str) -> list[str]:
        """The Hugging Face tensors a parallel model's tensor holds: itself, or for the GQA
        projection's ``weight_k`` its ``k_proj.weight``, for ``weight_qkv`` the Q, K and V
        weights (in that order)."""
        spec = cls.spec
        projections = (("q", spec.q_proj), ("k", spec.k_proj), ("v", spec.v_proj))
        for kind in ("weight", "bias"):
            fused = f".{GQA_NAME}.{kind}_qkv"
            if name.endswith(fused):
                return [f"{name[: -len(fused)]}.{proj}.{kind}" for _, proj in projections]
            for part, proj in projections:
                suffix = f".{GQA_NAME}.{kind}_{part}"
                if name.endswith(suffix):
                    return [f"{name[: -len(suffix)]}.{proj}.{kind}"]
        return [name]
