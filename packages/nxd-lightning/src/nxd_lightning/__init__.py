"""nxd-lightning: NxD's Lightning integration on ``lightning.pytorch`` 2.6, TP and PP on CPU,
CUDA and XLA devices.

    from lightning.pytorch import Trainer
    from nxd_lightning import (NeuronLTModule, NeuronTensorBoardLogger, NeuronTQDMProgressBar,
                               NeuronXLAPrecisionPlugin, NxDStrategy)

    module = NeuronLTModule(get_model, nxd_config, torch.optim.AdamW, None, opt_kwargs={"lr": 1e-3})
    trainer = Trainer(accelerator="cpu", devices=4, max_steps=100,
                      strategy=NxDStrategy(nxd_config),
                      plugins=[NeuronXLAPrecisionPlugin()],
                      callbacks=[NeuronTQDMProgressBar()],
                      logger=NeuronTensorBoardLogger(save_dir="logs"))
    trainer.fit(module, train_dataloaders=loader)

* :class:`NxDStrategy` (and NxD's name :class:`NeuronXLAStrategy`): process groups through
  nxd_state, the ``[PP, DP, TP]`` layout, a sampler over data parallelism, sharded checkpoints;
* :class:`NeuronLTModule`: the model and optimizer through nxd-trainer, manual optimisation with
  gradient accumulation, the loss logged from the rank that holds it;
* :class:`NeuronXLAPrecisionPlugin`: fp32, or bf16 with fp32 master weights;
* :class:`NeuronTQDMProgressBar`, :class:`NeuronTensorBoardLogger`: one bar and one event stream
  for the job;
* :class:`NeuronCheckpointIO`: Lightning checkpoints as nxd-ckpt tags (safetensors + JSON);
* :class:`NeuronHooksCallback`: NxD's activation / gradient dumps of chosen layers.
"""

from importlib.metadata import version as _version

from nxd_lightning._folder_load import install as _install_folder_loading
from nxd_lightning.checkpoint_io import NeuronCheckpointIO
from nxd_lightning.hooks_callback import NeuronHooksCallback
from nxd_lightning.logger import NeuronTensorBoardLogger
from nxd_lightning.module import NeuronLTModule
from nxd_lightning.precision import NeuronXLAPrecisionPlugin
from nxd_lightning.progress_bar import NeuronTQDMProgressBar
from nxd_lightning.strategy import NeuronXLAStrategy, NxDStrategy

# Model.load_from_checkpoint(folder) reads nxd-lightning's checkpoint folders (_folder_load).
_install_folder_loading()

__version__ = _version("nxd-lightning")

__all__ = [
    "NeuronCheckpointIO",
    "NeuronHooksCallback",
    "NeuronLTModule",
    "NeuronTQDMProgressBar",
    "NeuronTensorBoardLogger",
    "NeuronXLAPrecisionPlugin",
    "NeuronXLAStrategy",
    "NxDStrategy",
    "__version__",
]
