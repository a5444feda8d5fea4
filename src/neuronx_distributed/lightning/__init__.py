"""NxD's ``neuronx_distributed.lightning``: the Lightning 2.6 integration of :mod:`nxd_lightning`
(``NxDStrategy`` is the portable name of ``NeuronXLAStrategy``: CPU, CUDA and XLA)."""

from nxd_lightning import (
    NeuronCheckpointIO,
    NeuronHooksCallback,
    NeuronLTModule,
    NeuronTensorBoardLogger,
    NeuronTQDMProgressBar,
    NeuronXLAPrecisionPlugin,
    NeuronXLAStrategy,
    NxDStrategy,
)

__all__ = [
    "NeuronCheckpointIO",
    "NeuronHooksCallback",
    "NeuronLTModule",
    "NeuronTQDMProgressBar",
    "NeuronTensorBoardLogger",
    "NeuronXLAPrecisionPlugin",
    "NeuronXLAStrategy",
    "NxDStrategy",
]
