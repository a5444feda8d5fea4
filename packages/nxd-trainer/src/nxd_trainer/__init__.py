"""nxd-trainer: NxD's training API on CPU (gloo), CUDA (NCCL) and XLA.

The reference's sample, with its import line changed::

    import nxd_trainer as nxd

    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
    )
    model = nxd.initialize_parallel_model(nxd_config, get_model)
    optimizer = nxd.initialize_parallel_optimizer(nxd_config, AdamW, model.parameters(), lr=1e-3)
    if nxd.has_checkpoint("ckpts"):  # auto-resume: the newest complete tag
        user_content = nxd.load_checkpoint("ckpts", model=model, optimizer=optimizer)
    for batch in batches:
        loss = model.run_train(**batch)
        optimizer.step()
        optimizer.zero_grad()
    nxd.save_checkpoint("ckpts", "step_100", nxd_config=nxd_config, model=model,
                        optimizer=optimizer, user_content={"total_steps": 100})

* :func:`neuronx_distributed_config` returns NxD's dict, validated through :class:`NxDConfig`
  and its sections, and initialises model parallelism;
* :func:`initialize_parallel_model` builds the model (meta-device init, pipeline stages, padding,
  LoRA, activation checkpointing) and wraps it in :class:`NxDModel`;
* :func:`initialize_parallel_optimizer` builds ``nxd_optim.NxDOptimizer`` (ZeRO-1, clipping,
  master weights) and makes it the one place gradients are averaged over data parallelism;
* :func:`save_checkpoint` / :func:`load_checkpoint` write and read the whole training state
  (model, optimizer, scheduler, RNG, user content) through nxd-ckpt.
"""

from __future__ import annotations

from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from nxd_trainer._lazy import lazy_exports

if TYPE_CHECKING:
    from nxd_trainer.activation_checkpoint import (
        apply_activation_checkpointing,
        checkpointed_modules,
        is_checkpointed,
    )
    from nxd_trainer.checkpoint import (
        finalize_checkpoint,
        has_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from nxd_trainer.config import NxDConfig, neuronx_distributed_config
    from nxd_trainer.model import NxDModel, select_loss
    from nxd_trainer.sections import (
        MixedPrecisionConfig,
        ModelInitConfig,
        OptimizerConfig,
        PipelineConfig,
    )
    from nxd_trainer.trainer import (
        initialize_parallel_model,
        initialize_parallel_optimizer,
        optimizer_param_names,
    )

__version__ = _version("nxd-trainer")

# The public names and the module of each. They are imported on first use (PEP 562), so
# ``import nxd_trainer.train.cli`` (the ``nxd-train`` entry point) does not import torch:
# ``nxd-train --help`` answers at once and Ctrl-C during the heavy imports is handled there.
_EXPORTS = {
    "apply_activation_checkpointing": "activation_checkpoint",
    "checkpointed_modules": "activation_checkpoint",
    "is_checkpointed": "activation_checkpoint",
    "finalize_checkpoint": "checkpoint",
    "has_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "NxDConfig": "config",
    "neuronx_distributed_config": "config",
    "NxDModel": "model",
    "select_loss": "model",
    "MixedPrecisionConfig": "sections",
    "ModelInitConfig": "sections",
    "OptimizerConfig": "sections",
    "PipelineConfig": "sections",
    "initialize_parallel_model": "trainer",
    "initialize_parallel_optimizer": "trainer",
    "optimizer_param_names": "trainer",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = [
    "MixedPrecisionConfig",
    "ModelInitConfig",
    "NxDConfig",
    "NxDModel",
    "OptimizerConfig",
    "PipelineConfig",
    "__version__",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "finalize_checkpoint",
    "has_checkpoint",
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "is_checkpointed",
    "load_checkpoint",
    "neuronx_distributed_config",
    "optimizer_param_names",
    "save_checkpoint",
    "select_loss",
]
