"""open-nxd (the meta-install): every module of the `neuronx_distributed` compatibility package
imports, re-exports are the nxd objects themselves, and the `nxd-train` command is installed."""

import importlib
import importlib.metadata
import pkgutil
import subprocess
import sys
from pathlib import Path

import neuronx_distributed
import nxd_layers
import nxd_lightning
import nxd_pipeline
import nxd_trainer


def main() -> None:
    assert neuronx_distributed.__version__ == importlib.metadata.version("open-nxd")
    names = [neuronx_distributed.__name__]
    prefix = neuronx_distributed.__name__ + "."
    names += [m.name for m in pkgutil.walk_packages(neuronx_distributed.__path__, prefix)]
    for name in names:
        importlib.import_module(name)
    assert len(names) > 30, names  # the whole tree was walked, not an empty folder
    from neuronx_distributed.lightning import NeuronLTModule
    from neuronx_distributed.parallel_layers import ColumnParallelLinear
    from neuronx_distributed.pipeline import NxDPPModel

    assert ColumnParallelLinear is nxd_layers.ColumnParallelLinear
    assert NxDPPModel is nxd_pipeline.NxDPPModel
    assert NeuronLTModule is nxd_lightning.NeuronLTModule
    assert neuronx_distributed.neuronx_distributed_config is nxd_trainer.neuronx_distributed_config
    command = Path(sys.executable).with_name("nxd-train")
    subprocess.run([str(command), "--help"], check=True, capture_output=True)
    print(f"open-nxd smoke: ok ({len(names)} modules)", file=sys.stderr)


if __name__ == "__main__":
    main()
