"""``NeuronTensorBoardLogger``: one TensorBoard event stream for the job.

Lightning's logger writes from global rank 0 only, which at PP > 1 holds no loss; NxD's writes
from the last pipeline stage (DP rank 0, TP rank 0), or from rank 0 with ``log_rank0``. So does
this one: on every other rank ``experiment`` is a no-op object and nothing is written.
NxD's ``print_step`` is kept: left unset, Lightning's step is used; set by a script to ``-1`` it
suppresses writing, to ``n >= 0`` it is the step written.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.loggers.logger import _DummyExperiment
from lightning.fabric.loggers.tensorboard import TensorBoardLogger as _FabricTensorBoardLogger
from lightning.fabric.utilities.logger import _add_prefix, _convert_params
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import nxd_state
from nxd_lightning._ranks import is_logging_rank

__all__ = ["NeuronTensorBoardLogger"]


class NeuronTensorBoardLogger(TensorBoardLogger):
    """NxD's ``NeuronTensorBoardLogger(save_dir)``; other keywords go to Lightning's
    ``TensorBoardLogger``."""

    def __init__(self, save_dir: str, log_rank0: bool = False, **kwargs: Any) -> None:
        super().__init__(save_dir=save_dir, **kwargs)
        self.log_rank0 = log_rank0
        self._print_step: int | None = None

    @property
    def print_step(self) -> int | None:
        return self._print_step

    @print_step.setter
    def print_step(self, value: int | None) -> None:
        self._print_step = value

    def should_print(self) -> bool:
        """Whether this rank writes (before model parallelism exists: global rank 0)."""
        if self._print_step is not None and self._print_step < 0:
            return False
        if not nxd_state.model_parallel_is_initialized():
            # lightning_utilities sets `rank` on the function at import; its type does not say so.
            return rank_zero_only.rank == 0  # type: ignore[attr-defined]
        return is_logging_rank(self.log_rank0)

    @property
    def experiment(self) -> Any:
        if not self.should_print():
            return _DummyExperiment()
        if self._experiment is not None:
            return self._experiment
        if self.root_dir:
            self._fs.makedirs(self.root_dir, exist_ok=True)
        writer: Callable[..., Any]
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter
        except ImportError:  # no tensorboard package: tensorboardX (a dependency) writes
            import tensorboardX

            writer = tensorboardX.SummaryWriter
        self._experiment = writer(log_dir=self.log_dir, **self._kwargs)
        return self._experiment

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self.should_print():
            return
        if self._print_step is not None:
            step = self._print_step
        prefixed = _add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        for key, metric in prefixed.items():
            value = metric.item() if hasattr(metric, "item") else metric
            if isinstance(value, dict):
                self.experiment.add_scalars(key, value, step)
            else:
                self.experiment.add_scalar(key, value, step)

    def log_hyperparams(self, params: Any, metrics: Any = None, step: int | None = None) -> None:
        if not self.should_print():
            return
        self.hparams.update(_convert_params(params))
        # Lightning's body without its rank-zero guard (this logger picks its own rank).
        inspect.unwrap(_FabricTensorBoardLogger.log_hyperparams)(self, params, metrics, step)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        if self.should_print():
            inspect.unwrap(TensorBoardLogger.log_graph)(self, model, input_array)

    def save(self) -> None:
        if not self.should_print():
            return
        self.experiment.flush()
        inspect.unwrap(TensorBoardLogger.save)(self)  # hparams.yaml

    def finalize(self, status: str) -> None:
        if not self.should_print() or self._experiment is None:
            return
        self._experiment.flush()
        if status == "success":
            self.save()
        self._experiment.close()
