"""Start the workers through PyTorch's own launcher (``torch.distributed.run``'s elastic API).

``nxd-train`` run plainly is the launcher: it turns its launch flags into torchrun's
(``--nproc-per-node``, ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``), lets
``torch.distributed.run.config_from_args`` resolve them exactly as ``torchrun`` would, and
starts ``python -m nxd_trainer.train <the same arguments>`` per worker with ``elastic_launch``.
A worker sees torchrun's environment and trains. One node: ``--standalone``'s settings
(c10d rendezvous on a free local port). Several: a static rendezvous at ``--rdzv-endpoint``
with ``--node-rank``, or torch's c10d rendezvous when no node rank is given.
``torchrun -m nxd_trainer.train ...`` works too.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from nxd_trainer.train.config import TrainConfig

__all__ = ["WORKER_BOOT", "launch", "torchrun_args", "under_torchrun", "worker_command"]

EXIT_INTERRUPTED = 130
EXIT_BAD_INPUT = 2


def under_torchrun() -> bool:
    """Whether this process is a worker started by torchrun / the elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def torchrun_args(cfg: TrainConfig, argv: list[str]) -> list[str]:
    """torchrun's command line for this run (what ``launch`` hands to its parser)."""
    args = ["--nnodes", str(cfg.nnodes), "--nproc-per-node", str(cfg.nproc_per_node)]
    args += ["--max-restarts", "0", "--monitor-interval", "0.2"]
    if cfg.nnodes == 1 and cfg.rdzv_endpoint is None:  # torchrun --standalone's settings
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                 "--rdzv-id", str(uuid.uuid4())]  # fmt: skip
    elif cfg.node_rank is not None:
        assert cfg.rdzv_endpoint is not None
        args += ["--rdzv-backend", "static", "--rdzv-endpoint", cfg.rdzv_endpoint,
                 "--node-rank", str(cfg.node_rank)]  # fmt: skip
    else:
        assert cfg.rdzv_endpoint is not None
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", cfg.rdzv_endpoint,
                 "--rdzv-id", f"nxd-train-{cfg.name}"]  # fmt: skip
    return [*args, "--module", "nxd_trainer.train", *argv]


# What each worker runs: ``python -u -c WORKER_BOOT <arguments>``. Before anything is
# imported, Ctrl-C or SIGTERM ends the worker quietly with 130 (its launcher says it in one
# line); ``python -m nxd_trainer.train`` would import the ``nxd_trainer`` package (torch) with
# Python's default handler, whose KeyboardInterrupt prints a traceback. ``cli.main`` installs
# the real handlers once it runs.
WORKER_BOOT = (
    "import os, runpy, signal\n"
    "def _quiet(signum, frame):\n"
    f"    os._exit({EXIT_INTERRUPTED})\n"
    "signal.signal(signal.SIGINT, _quiet)\n"
    "signal.signal(signal.SIGTERM, _quiet)\n"
    "runpy.run_module('nxd_trainer.train', run_name='__main__', alter_sys=True)\n"
)


def worker_command(cmd_args: list[str]) -> list[str]:
    """torchrun's ``-u -m nxd_trainer.train ARGS`` as ``-u -c WORKER_BOOT ARGS``."""
    head = ["-u", "-m", "nxd_trainer.train"]
    if cmd_args[: len(head)] != head:
        raise AssertionError(f"unexpected worker command from torchrun: {cmd_args}")
    return ["-u", "-c", WORKER_BOOT, *cmd_args[len(head) :]]


def _quiet_elastic() -> None:
    """The agent logs every worker exit as a warning and failures with a report; the launcher
    says what happened in one line instead."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(cfg: TrainConfig, argv: list[str]) -> int:
    """Run the workers; their exit status (130: interrupted, saved)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun would (silently)
        threads = max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    parsed = get_args_parser().parse_args(torchrun_args(cfg, argv))
    config, cmd, cmd_args = config_from_args(parsed)
    _quiet_elastic()
    try:
        elastic_launch(config, cmd)(*worker_command(cmd_args))
    except ChildFailedError as error:
        codes = sorted({f.exitcode for f in error.failures.values()})
        if EXIT_INTERRUPTED in codes:  # the others stopped because of it
            return EXIT_INTERRUPTED
        if EXIT_BAD_INPUT in codes:  # a worker found bad input and said so in one line
            return EXIT_BAD_INPUT
        ranks = sorted(error.failures)
        print(
            f"nxd-train: worker rank(s) {ranks} exited with status {codes} (their messages are "
            "above)",
            file=sys.stderr,
        )
        return 1
    except SignalException:
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return 0
