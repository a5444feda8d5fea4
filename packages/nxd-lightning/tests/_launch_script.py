"""A training script as a user writes it, started with ``python _launch_script.py OUT``:
Lightning's own launcher (``start_method="popen"``) starts the second process. TP=2 on 2 CPU
processes, on a stock Hugging Face Llama (parallelized by ``initialize_parallel_model``); every
rank writes ``OUT/rank<r>.json`` with its step losses (null where not held)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer

from nxd_lightning import NeuronLTModule, NeuronTQDMProgressBar, NxDStrategy
from nxd_trainer import neuronx_distributed_config

spec = importlib.util.spec_from_file_location("_recipe", Path(__file__).with_name("_recipe.py"))
assert spec is not None
assert spec.loader is not None
R = importlib.util.module_from_spec(spec)
spec.loader.exec_module(R)

STEPS = 3


def main(out: Path) -> None:
    # NxD's flow: the config first, in the process Lightning then launches from. It builds no
    # process group here (no launcher set RANK), so the strategy makes the Trainer's own.
    config = neuronx_distributed_config(
        tensor_parallel_size=2,
        optimizer_config={"grad_clipping": True, "max_grad_norm": R.MAX_GRAD_NORM},
    )
    assert not torch.distributed.is_initialized()
    module = NeuronLTModule(R.hf_llama, config, torch.optim.AdamW, None, opt_kwargs=R.ADAMW)
    recorder = R.LossRecorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=NxDStrategy(config),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[recorder, NeuronTQDMProgressBar()],
    )
    trainer.fit(module, train_dataloaders=R.loader())
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "losses": recorder.losses,
                "world": torch.distributed.get_world_size(),
                "tp_layers": R.tp_layers(module.model),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
