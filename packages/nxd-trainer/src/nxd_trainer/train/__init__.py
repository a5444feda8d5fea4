"""``nxd-train``, nxd's main job: train a causal LM with any TP/PP/DP mix.

    nxd-train                      # tiny Llama, TP=2 on 2 CPU processes, stdlib corpus
    nxd-train --tp 2 --pp 2 --nproc-per-node 4 --microbatches 2
    nxd-train export runs/tiny     # Hugging Face folder of the newest checkpoint

Built only on the public pieces: the HF parallelizer (:mod:`nxd_trainer.hf`),
``initialize_parallel_model`` / ``_optimizer`` and ``save`` / ``load_checkpoint``; workers
are started by ``torch.distributed.run``'s elastic API. A :class:`Trainer` holds one rank's
state and step; a :class:`RunDir` owns the run folder. Needs the ``train`` extra
(``pip install "nxd-trainer[train]"``: transformers, tokenizers, tqdm, tensorboardX, filelock,
tomli-w).

The names below are imported on first use, so the command line starts without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nxd_trainer._lazy import lazy_exports

if TYPE_CHECKING:
    from nxd_trainer.train.cli import build_parser, main, parse_config
    from nxd_trainer.train.config import ConfigError, TrainConfig, load_toml
    from nxd_trainer.train.data import (
        PackedLoader,
        load_corpus,
        prepare_data,
        train_tokenizer,
    )
    from nxd_trainer.train.export import export_run, generate_sample
    from nxd_trainer.train.launch import torchrun_args, under_torchrun
    from nxd_trainer.train.layout import format_layout
    from nxd_trainer.train.loop import run_worker
    from nxd_trainer.train.rundir import RunDir
    from nxd_trainer.train.trainer import StepResult, Trainer

_EXPORTS = {
    "build_parser": "cli",
    "main": "cli",
    "parse_config": "cli",
    "ConfigError": "config",
    "TrainConfig": "config",
    "load_toml": "config",
    "PackedLoader": "data",
    "load_corpus": "data",
    "prepare_data": "data",
    "train_tokenizer": "data",
    "export_run": "export",
    "generate_sample": "export",
    "torchrun_args": "launch",
    "under_torchrun": "launch",
    "format_layout": "layout",
    "run_worker": "loop",
    "RunDir": "rundir",
    "StepResult": "trainer",
    "Trainer": "trainer",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = [
    "ConfigError",
    "PackedLoader",
    "RunDir",
    "StepResult",
    "TrainConfig",
    "Trainer",
    "build_parser",
    "export_run",
    "format_layout",
    "generate_sample",
    "load_corpus",
    "load_toml",
    "main",
    "parse_config",
    "prepare_data",
    "run_worker",
    "torchrun_args",
    "train_tokenizer",
    "under_torchrun",
]
