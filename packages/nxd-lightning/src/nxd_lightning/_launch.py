"""How the NxD strategy's processes start: Lightning's own launchers, or none.

* ``torchrun`` (or any launcher that sets ``LOCAL_RANK``, as
  ``nxd_state.testing.run_distributed`` does): every process runs the script; Lightning
  launches nothing.
* ``start_method="popen"`` (the default, Lightning's ``"ddp"``): the script is run again in one
  subprocess per extra device (``_SubprocessScriptLauncher``); the first process is rank 0.
* ``"spawn"`` / ``"fork"`` / ``"forkserver"``: ``fit`` runs in N worker processes
  (``_MultiProcessingLauncher``). Lightning would copy rank 0's ``state_dict`` back to the main
  process at the end; with TP/PP each rank holds only a shard, so nothing is copied back here
  (the trainer state and callback metrics are): keep the model by checkpointing it.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput

__all__ = ["ShardedMultiProcessingLauncher"]


class ShardedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, without the rank-0 weight copy (see module doc)."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback is not None else None
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best, None, trainer.state, results, extra)
