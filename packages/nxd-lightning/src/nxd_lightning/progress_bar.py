"""``NeuronTQDMProgressBar``: one progress bar for the job, on the rank that holds the loss.

Lightning's bar shows on global rank 0, which at PP > 1 holds no loss. This one shows on
data-parallel rank 0, tensor-parallel rank 0 of the last pipeline stage (pipeline rank 0, i.e.
global rank 0, with the module's ``log_rank0``), and is disabled everywhere else.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar

from nxd_lightning._ranks import is_logging_rank

__all__ = ["NeuronTQDMProgressBar"]


class NeuronTQDMProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, enabled on the one logging rank only."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        if is_logging_rank(bool(getattr(pl_module, "log_rank0", False))):
            self.enable()
        else:
            self.disable()
