"""nxd-trainer: NxD's training API on CPU (gloo), CUDA (NCCL) and XLA.

The reference's sample, with its import line changed::

    import nxd_trainer as nxd

    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
    )
    model = nxd.initialize_parallel_model(nxd_config, get_model)
    optimizer = nxd.initialize_parallel_optimizer(nxd_config, AdamW, model.parameters(), lr=1e-3)
    for batch in batches:
        loss = model.run_train(**batch)
        optimizer.step()
        optimizer.zero_grad()

* :func:`neuronx_distributed_config` returns NxD's dict, validated through :class:`NxDConfig`
  and its sections, and initialises model parallelism;
* :func:`initialize_parallel_model` builds the model (meta-device init, pipeline stages, padding,
  LoRA, activation checkpointing) and wraps it in :class:`NxDModel`;
* :func:`initialize_parallel_optimizer` builds ``nxd_optim.NxDOptimizer`` (ZeRO-1, clipping,
  master weights) and makes it the one place gradients are averaged over data parallelism.
"""

from importlib.metadata import version as _version

from nxd_trainer.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpointed_modules,
    is_checkpointed,
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
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "is_checkpointed",
    "neuronx_distributed_config",
    "optimizer_param_names",
    "select_loss",
]
