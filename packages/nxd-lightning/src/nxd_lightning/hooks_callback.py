"""``NeuronHooksCallback``: NxD's activation and gradient dumps of chosen layers.

For each layer named in ``cfg.target_layers`` (comma-separated module names of
``pl_module.model``), every ``cfg.hooks_interval`` steps, the first tensor of the layer's
input and output (forward hook, ``enable_activation_dumps``) and of its input and output
gradients (full backward hook, ``enable_grad_dumps``) are copied to the CPU and written to

    <base>/<layer>/global_step_<step>/<dp{d}_pp{p}_tp{t}>_{layer,grad}_{input,output}_{raw,norm}.pt

with ``<base> = ./hooks_outputs/<SLURM_JOB_ID>/hooks_dumps``, as NxD lays them out: the tensor
itself, or with ``dump_only_norms`` its 2-norm ‖x‖₂ (a float). ``dump_only_master_rank`` writes
global rank 0's only; with it and ``dump_only_norms`` the norms can also be logged through
``pl_module.log`` (``enable_tb_logging_master_rank_{activation,grad}_norms``).
``master_print_model_layers`` prints the model's module names on rank 0 at the start.

The files hold plain tensors and floats: ``torch.load(path, weights_only=True)`` reads them.
On CPU and CUDA they are written in the hook; NxD defers that to an XLA step closure.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

__all__ = ["NeuronHooksCallback"]

_FIELDS = (
    "master_print_model_layers",
    "target_layers",
    "dump_only_master_rank",
    "dump_only_norms",
    "hooks_interval",
    "enable_activation_dumps",
    "enable_grad_dumps",
    "enable_tb_logging_master_rank_activation_norms",
    "enable_tb_logging_master_rank_grad_norms",
)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rank_info() -> str:
    """``dp{d}_pp{p}_tp{t}`` of this rank (``dp0_pp0_tp0`` without model parallelism)."""
    import nxd_state

    if not nxd_state.model_parallel_is_initialized():
        return "dp0_pp0_tp0"
    state = nxd_state.get_parallel_state()
    return (
        f"dp{state.data_parallel_rank}_pp{state.pipeline_parallel_rank}"
        f"_tp{state.tensor_parallel_rank}"
    )


def _first(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


class NeuronHooksCallback(Callback):
    """NxD's ``NeuronHooksCallback(cfg)``: ``cfg`` has NxD's attributes (module docstring);
    ``cfg.hooks`` False (or missing) turns everything off."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.hooks = bool(getattr(cfg, "hooks", False))
        self.target_layers: list[str] = []
        self.master_print_model_layers = False
        self.enable_activation_dumps = self.enable_grad_dumps = False
        self.dump_only_master_rank = self.dump_only_norms = False
        self.enable_tb_logging_master_rank_activation_norms = False
        self.enable_tb_logging_master_rank_grad_norms = False
        self.hooks_interval = 1
        self.hooks_dump_base_directory: str | None = None
        self.activations_map: dict[str, list[tuple[int, Any, Any]]] | None = None
        self.gradients_map: dict[str, list[tuple[int, Any, Any]]] | None = None
        if not self.hooks:
            return
        missing = [name for name in _FIELDS if not hasattr(cfg, name)]
        if missing:
            raise ValueError(f"NeuronHooksCallback: cfg.hooks is set but cfg lacks {missing}")
        for name in _FIELDS:
            if name != "target_layers":
                setattr(self, name, getattr(cfg, name))
        interval = self.hooks_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"cfg.hooks_interval must be a positive int, got {interval!r}")
        self.target_layers = [t.strip() for t in str(cfg.target_layers).split(",") if t.strip()]
        job = os.environ.get("SLURM_JOB_ID")
        self.hooks_dump_base_directory = f"./hooks_outputs/{job}/hooks_dumps"
        self.activations_map, self.gradients_map = {}, {}

    # Recording ---------------------------------------------------------------------------------
    def process_input_output(self, input: Any, output: Any) -> tuple[Any, Any]:
        """The first tensor of each, detached on the CPU; its 2-norm with ``dump_only_norms``."""
        pair: list[torch.Tensor | float | None] = []
        for value in (input, output):
            tensor = _first(value)
            if tensor is None:
                pair.append(None)
                continue
            tensor = tensor.detach().clone().cpu()
            pair.append(tensor.norm().item() if self.dump_only_norms else tensor)
        return pair[0], pair[1]

    def _record(self, book: dict, layer: str, step: int, pair: tuple[Any, Any]) -> None:
        if not self.dump_only_master_rank or _global_rank() == 0:
            book.setdefault(layer, []).append((step, *pair))

    def _save(self, book: dict, kind: str, pl_module: LightningModule) -> None:
        """Write and forget what ``book`` holds (``kind``: ``layer`` or ``grad``)."""
        postfix = "norm" if self.dump_only_norms else "raw"
        log_norms = self.dump_only_master_rank and self.dump_only_norms
        log_norms = log_norms and (
            self.enable_tb_logging_master_rank_activation_norms
            if kind == "layer"
            else self.enable_tb_logging_master_rank_grad_norms
        )
        assert self.hooks_dump_base_directory is not None
        for layer, records in book.items():
            for step, first, second in records:
                folder = Path(self.hooks_dump_base_directory) / layer / f"global_step_{step}"
                folder.mkdir(parents=True, exist_ok=True)
                stem = f"{_rank_info()}_{kind}"
                for side, value in (("input", first), ("output", second)):
                    if value is not None:
                        torch.save(value, folder / f"{stem}_{side}_{postfix}.pt")
                if log_norms:
                    name = "activation" if kind == "layer" else "grad"
                    for side, value in (("input", first), ("output", second)):
                        if value is not None:
                            pl_module.log(f"{name}_{side}_norm", value, on_step=True)
        book.clear()

    def create_forward_hook(self, layer_name: str, pl_module: LightningModule) -> Any:
        def hook(module: nn.Module, input: Any, output: Any) -> None:
            if pl_module.global_step % self.hooks_interval == 0:
                assert self.activations_map is not None
                pair = self.process_input_output(input, output)
                self._record(self.activations_map, layer_name, pl_module.global_step, pair)
                self._save(self.activations_map, "layer", pl_module)

        return hook

    def create_backward_hook(self, layer_name: str, pl_module: LightningModule) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if pl_module.global_step % self.hooks_interval == 0:
                assert self.gradients_map is not None
                pair = self.process_input_output(grad_input, grad_output)
                self._record(self.gradients_map, layer_name, pl_module.global_step, pair)
                self._save(self.gradients_map, "grad", pl_module)

        return hook

    # Lightning ---------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.hooks:
            return
        model = pl_module.model
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"NeuronHooksCallback hooks the layers of pl_module.model, an nn.Module; "
                f"{type(pl_module).__name__}.model is a {type(model).__name__}"
            )
        if self.master_print_model_layers and _global_rank() == 0:
            print("Printing Model Layers:", flush=True)
            for name, _ in model.named_modules():
                print(name, flush=True)
        found = set()
        for name, layer in model.named_modules():
            if name not in self.target_layers:
                continue
            found.add(name)
            if self.enable_activation_dumps:
                layer.register_forward_hook(self.create_forward_hook(name, pl_module))
            if self.enable_grad_dumps:
                layer.register_full_backward_hook(self.create_backward_hook(name, pl_module))
        # Under pipeline parallelism a rank holds some layers only: each rank hooks its own.
        if not found and self.target_layers:
            print(
                f"NeuronHooksCallback: none of {self.target_layers} is a module on global rank "
                f"{_global_rank()}",
                flush=True,
            )
